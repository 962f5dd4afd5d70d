"""K/V projections when there are fewer KV heads than TP ranks: each rank computes the one KV head its
query heads share, from a full replicated weight whose gradient is summed over TP afterwards."""

from __future__ import annotations

import torch
from torch import nn

from plait.distributed.context import ParallelContext
from plait.errors import ConfigError
from plait.tensor_parallel.layers import TPShardedModule, mark_tp_partial, new_param
from plait.tensor_parallel.regather import kept_input
from plait.weight_grad import linear


class ReplicatedHeadsLinear(TPShardedModule):
    """A K or V projection for grouped-query attention with ``n_kv_heads < tp`` (tp a multiple of it).

    Rank r's query heads all belong to KV group ``r // (tp / n_kv_heads)``; the weight is replicated on
    every rank and each rank only uses that group's rows, so each rank's weight gradient is a partial
    sum (marked TP-partial, summed over TP by ``sync_tp_partial_grads``). The input must already be in
    the TP region (the attention's single ``f`` / sequence all-gather), as for a column-parallel layer.
    """

    def __init__(self, linear: nn.Linear, n_kv_heads: int, ctx: ParallelContext):
        super().__init__()
        t = ctx.tp_size
        if n_kv_heads >= t or t % n_kv_heads:
            raise ConfigError(f"ReplicatedHeadsLinear needs tp ({t}) to be a multiple of n_kv_heads "
                              f"({n_kv_heads}) and larger than it")
        self.ctx, self.in_features, self.out_features = ctx, linear.in_features, linear.out_features
        self.head_dim = linear.out_features // n_kv_heads
        self.group_index = ctx.tp_rank // (t // n_kv_heads)
        self.shard_dims = {"weight": (None, linear.out_features), "bias": (None, linear.out_features)}
        self.weight = new_param(linear.weight)  # [n_kv*hd, H], replicated
        self.bias = new_param(linear.bias) if linear.bias is not None else None
        for p in self.parameters():
            mark_tp_partial(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, S, H] -> [B, S, hd] (one KV head)
        rows = slice(self.group_index * self.head_dim, (self.group_index + 1) * self.head_dim)
        bias = self.bias[rows] if self.bias is not None else None
        # the rows are no leaf: the weight gradient is never deferred (an SP region's input: kept as its shard)
        return linear(x, self.weight[rows], bias, None, kept_input(x))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} (uses KV head {self.group_index})"
