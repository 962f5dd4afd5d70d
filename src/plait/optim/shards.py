"""Which gradient elements a rank counts in the global norm and which it owns under ZeRO.

Every element of the full model's gradient must be counted exactly once over the world:
- TP: a sharded parameter (``shard_dims`` dim not None) is counted on every TP rank (disjoint shards);
  a replicated one (norms, row-parallel biases, replicated KV heads) is identical on every TP rank
  after ``train_step``, so only ``tp_rank 0`` counts it.
- PP: a parameter lives on one pipeline rank, except tied embeddings (one copy per holding rank, equal
  gradients after the tie sync): only the lowest global rank of the tie group counts it.
- DP: the gradients are laid end to end in buckets (``data_parallel.reducer``), each cut into ``d`` equal
  shards; DP rank r counts — and under ZeRO owns — shard r of every bucket (Rajbhandari et al. 2020,
  "ZeRO", §5.1). After the reduction rank r holds (at least) the sum of its shards.
Parameters whose gradient is reduced over another group (``data_parallel.reducer.set_grad_group``, e.g.
experts over the expert-data-parallel group, which holds every copy of them) are sharded over that group
instead, and each member counts its own shard.
Vocabulary padding rows are zero with zero gradient: counted, they add nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from plait.data_parallel.reducer import Bucket, GradReducer, grad_group
from plait.tensor_parallel.layers import TPShardedModule


@dataclass
class Piece:
    """The part of one parameter inside this rank's shard of a gradient bucket."""

    name: str
    param: nn.Parameter
    reducer: GradReducer
    bucket: Bucket
    lo: int        # param.view(-1)[lo:hi] is in the shard
    hi: int
    at: int        # where element lo sits in the bucket's [shard] tensor
    counted: bool  # counted in the global norm by this rank
    # (the bucket buffer's shard, this piece's view of it): made once per buffer, not per read
    _view: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    def grad(self) -> torch.Tensor:
        """The reduced gradient of the piece: a flat view of the bucket's shard ([hi - lo])."""
        shard = self.reducer.shard(self.bucket)
        if shard is self.bucket.reduced:  # a new tensor every step, freed by zero_grad: not kept here
            return shard[self.at:self.at + self.numel]
        if self._view is None or self._view[0] is not shard:
            self._view = (shard, shard[self.at:self.at + self.numel])
        return self._view[1]


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


class ShardLayout:
    """The pieces of a ParallelModel's parameters in this rank's shards of its gradient buckets."""

    def __init__(self, pm):
        ctx = pm.ctx
        names = {id(p): name for name, p in pm.named_model_parameters()}
        sharded, ties = _tp_sharded(pm), _tie_counted(pm)
        self.buckets: list[tuple[GradReducer, Bucket]] = pm.grad_buckets()
        self.by_bucket: list[list[Piece]] = []
        for reducer, b in self.buckets:
            stop = min(b.hi, b.numel)  # the shard without the bucket's padding
            mine = []
            for p, off in zip(b.params, b.offsets, strict=True):
                lo, hi = max(off, b.lo), min(off + p.numel(), stop)
                if lo >= hi:
                    continue
                own_group = grad_group(p) is not None  # the group holds every copy: count the shard
                counted = own_group or ((sharded.get(id(p), False) or ctx.tp_rank == 0) and ties.get(id(p), True))
                mine.append(Piece(names[id(p)], p, reducer, b, lo - off, hi - off, lo - b.lo, counted))
            self.by_bucket.append(mine)
        self.pieces: list[Piece] = [pc for mine in self.by_bucket for pc in mine]

    @property
    def owned(self) -> int:
        """Parameter elements in this rank's shards (padding excluded)."""
        return sum(pc.numel for pc in self.pieces)

    def describe(self) -> list:
        """Bucket geometry and pieces: identifies the layout of a saved per-rank optimizer state."""
        buckets = [(b.numel, b.size, b.index) for _, b in self.buckets]
        return [buckets, [(pc.name, pc.param.numel(), pc.lo, pc.hi) for pc in self.pieces]]
