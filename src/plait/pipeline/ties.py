"""Parameters shared by chunks on different pipeline ranks (tied embeddings): one copy per rank, gradients
summed over the ranks that hold a copy (Megatron's embedding group), so the copies stay equal."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from plait.distributed.collectives import collective
from plait.distributed.context import ParallelContext
from plait.pipeline.partition import PipelineChunk
from plait.schedules import Schedule


class TiedWeights:
    """Finds parameters used by several chunks and builds the groups that keep their copies in sync."""

    def __init__(self, chunks: Sequence[PipelineChunk], schedule: Schedule, ctx: ParallelContext):
        self.ctx = ctx
        self.pairs: list[tuple[nn.Parameter, ProcessGroup]] = []  # (this rank's copy, its tie group)
        holders: dict[int, set[int]] = {}
        objects: dict[int, nn.Parameter] = {}
        for chunk in chunks:
            for p in chunk.parameters():
                holders.setdefault(id(p), set()).add(schedule.stage_to_rank(chunk.index))
                objects[id(p)] = p
        shared = [(objects[i], sorted(r)) for i, r in holders.items() if len(r) > 1]
        # every rank creates every group, in the same order (new_group is collective over the world); the context
        # owns them (ctx.close() destroys them)
        for p, pp_ranks in shared:
            for dp in range(ctx.dp_size):
                for cp in range(ctx.cp_size):
                    for tp in range(ctx.tp_size):
                        members = [ctx.global_rank(tp_rank=tp, dp_rank=dp, pp_rank=r, cp_rank=cp) for r in pp_ranks]
                        group = ctx.new_group(members)
                        if group is not None:
                            self.pairs.append((p, group))

    def sync_grads(self, grad_of: Callable[[nn.Parameter], list[torch.Tensor]]) -> None:
        """Sum the gradients of the tied copies over the ranks that hold them.

        ``grad_of(p)``: the tensors holding ``p``'s reduced gradient on this rank (the same elements on every
        rank of its tie group: a tied copy has a gradient bucket of its own, see data_parallel.reducer).
        """
        for p, group in self.pairs:
            for g in grad_of(p):
                collective("all-reduce of tied weights' gradients", group,
                           lambda: dist.all_reduce(g, group=group))  # noqa: B023 (called at once)
