"""Which gradient elements a rank counts in the global norm and which slice it owns under ZeRO-1.

Every element of the full model's gradient must be counted exactly once over the world:
- TP: a sharded parameter (``shard_dims`` dim not None) is counted on every TP rank (disjoint shards);
  a replicated one (norms, row-parallel biases, replicated KV heads) is identical on every TP rank
  after ``train_step``, so only ``tp_rank 0`` counts it.
- PP: a parameter lives on one pipeline rank, except tied embeddings (one copy per holding rank, equal
  gradients after the tie sync): only the lowest global rank of the tie group counts it.
- DP: the gradients are equal on every DP rank after the reduction, so the local parameters are laid
  end to end (``pm.named_parameters()`` order, identical on every replica) and cut into ``dp`` equal
  slices; DP rank r counts — and under ZeRO-1 owns — slice r (Rajbhandari et al. 2020, "ZeRO", §5.1).
Parameters whose gradient is reduced over another group (``data_parallel.reducer.set_grad_group``, e.g.
experts over the expert-data-parallel group) are identical only within that group: each is counted whole
by the lowest global rank of its group, and is neither sliced over DP nor sharded by ZeRO-1.
Vocabulary padding rows are zero with zero gradient: counted, they add nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from plait.tensor_parallel.layers import TPShardedModule


@dataclass
class Slot:
    """One local parameter in the rank's flat layout, and the part of it this DP rank owns."""

    name: str
    param: nn.Parameter
    offset: int    # start of the parameter in the flat concatenation of this rank's parameters
    counted: bool  # counted in the global norm by this (tp, pp) coordinate
    lo: int        # owned elements: param.view(-1)[lo:hi] (lo == hi: none)
    hi: int
    group: object = None  # own gradient-reduction group (experts); None: the DP group
    group_size: int = 0

    @property
    def numel(self) -> int:
        return self.param.numel()


def _tp_sharded(pm) -> dict[int, bool]:
    """id(param) -> whether its elements are split over TP (False: replicated on every TP rank)."""
    out: dict[int, bool] = {}
    for chunk in pm.chunks.values():
        for key, tensor in chunk.named_state().items():
            if not isinstance(tensor, nn.Parameter):
                continue
            module, attr = chunk.owner(key)
            dim = module.shard_dims.get(attr, (None, 0))[0] if isinstance(module, TPShardedModule) else None
            out[id(tensor)] = dim is not None and pm.ctx.tp_size > 1
    return out


def _tie_counted(pm) -> dict[int, bool]:
    """id(param) -> whether this rank counts its tied copy (the lowest global rank of the tie group)."""
    return {id(p): pm.ctx.rank == min(dist.get_process_group_ranks(group)) for p, group in pm.ties.pairs}


class FlatLayout:
    """The slots of a ParallelModel's local parameters; DP slice ``dp_rank`` of ``shard`` elements each."""

    def __init__(self, pm):
        ctx = pm.ctx
        sharded, ties = _tp_sharded(pm), _tie_counted(pm)
        self.slots: list[Slot] = []  # replicated over DP: laid end to end, sliced over DP
        self.own: list[Slot] = []    # reduced over their own group: whole, never sliced
        offset = 0
        for name, p in pm.named_parameters():
            if not p.requires_grad:
                continue
            group, size = getattr(p, "_plait_grad_group", (None, 0))
            if size:
                leader = size == 1 or group is None or ctx.rank == min(dist.get_process_group_ranks(group))
                self.own.append(Slot(name, p, -1, leader, 0, p.numel(), group, size))
                continue
            counted = (sharded.get(id(p), False) or ctx.tp_rank == 0) and ties.get(id(p), True)
            self.slots.append(Slot(name, p, offset, counted, 0, 0))
            offset += p.numel()
        self.numel = offset
        self.dp_size, self.dp_rank = ctx.dp_size, ctx.dp_rank
        self.shard = math.ceil(offset / ctx.dp_size) if offset else 0  # elements per DP rank
        self.padded = self.shard * ctx.dp_size
        start, end = self.dp_rank * self.shard, (self.dp_rank + 1) * self.shard
        for s in self.slots:
            s.lo = min(max(start - s.offset, 0), s.numel)
            s.hi = max(min(end - s.offset, s.numel), s.lo)

    def owned(self) -> list[Slot]:
        return [s for s in self.slots if s.hi > s.lo]

    def describe(self) -> list[tuple[str, int, int, int]]:
        """(name, numel, lo, hi) per slot: identifies the layout in a saved optimizer state."""
        return [(s.name, s.numel, s.lo, s.hi) for s in self.slots + self.own]

    def flat_grads(self) -> torch.Tensor:
        """All local gradients end to end in float32, zero-padded to ``dp·shard``: [padded]."""
        parts = [s.param.grad.reshape(-1) if s.param.grad is not None else s.param.new_zeros(s.numel)
                 for s in self.slots]
        pad = self.padded - self.numel
        if pad:
            parts.append(parts[0].new_zeros(pad) if parts else torch.zeros(pad))
        return torch.cat(parts).float() if parts else torch.zeros(0)
