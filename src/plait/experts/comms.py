"""Expert-parallel collectives as autograd functions: variable-size all-to-all and token gathers.

all_to_all(x, out_splits, in_splits): row block i of ``x`` (in_splits[i] rows) goes to rank i of the
group; the result holds rank j's block for us at out_splits[j]. Its gradient is the same exchange in
reverse (splits swapped), so gradients flow back to the tokens' home ranks (Lepikhin et al. 2020, §3.2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.distributed.collectives import collective
from plait.tensor_parallel.comms import all_gather


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """All-to-all of per-expert counts: [E] (ours, for every expert) -> [ep, E/ep] (every rank's, for ours).

    The split sizes of the token all-to-all are exchanged first, so receivers can size their buffers.
    """
    ep = dist.get_world_size(group)
    out = torch.empty_like(counts)
    collective("ep all-to-all of expert counts", group,
               lambda: dist.all_to_all_single(out, counts.contiguous(), group=group))  # equal splits of E/ep counts
    return out.view(ep, -1)


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    collective("ep all-to-all of tokens", group,
               lambda: dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                                              input_split_sizes=in_splits, group=group))
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Variable-size all-to-all of rows of ``x`` [sum(in_splits), ...] -> [sum(out_splits), ...]."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


class _GatherRows(torch.autograd.Function):
    """Concatenate the ranks' row blocks of known (maybe unequal) sizes; backward keeps our block."""

    @staticmethod
    def forward(ctx, x, sizes, rank, group):
        ctx.start, ctx.size = sum(sizes[:rank]), sizes[rank]
        longest = max(sizes)
        padded = x if x.shape[0] == longest else torch.cat([x, x.new_zeros(longest - x.shape[0], *x.shape[1:])])
        full = all_gather(padded, 0, group, "all-gather of expert outputs")  # [t·longest, ...]
        return torch.cat([full[r * longest:r * longest + n] for r, n in enumerate(sizes)])

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(0, ctx.start, ctx.size), None, None, None


def gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """All-gather rows [sizes[rank], ...] -> [sum(sizes), ...]; the gradient of our rows comes back as is.

    For a replicated result (each rank holds the full gradient), so the backward is a plain slice.
    """
    if dist.get_world_size(group) == 1:
        return x
    return _GatherRows.apply(x, list(sizes), dist.get_rank(group), group)
