"""The conjugate tensor-parallel collectives as autograd functions (Shoeybi et al. 2019, Korthikanti et al. 2022).

f  = copy_to_tp:        identity forward, all-reduce backward (enters a TP region)
g  = reduce_from_tp:    all-reduce forward, identity backward (leaves a TP region)
gather_last / scatter_last: all-gather / split along the last (hidden) dimension
Sequence parallelism replaces g by reduce-scatter and f by all-gather along the sequence dimension:
gather_seq:             all-gather forward, reduce-scatter backward
reduce_scatter_seq:     reduce-scatter forward, all-gather backward
scatter_seq:            split forward, all-gather backward (replicated input -> sequence shards)
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from plait.distributed.collectives import all_gather_tensor, collective, reduce_scatter_tensor


def _size(group: ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def _rank(group: ProcessGroup | None) -> int:
    return dist.get_rank(group)


def _check_divisible(x: torch.Tensor, dim: int, t: int) -> None:
    if x.shape[dim] % t:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the group size {t}")


def all_reduce(x: torch.Tensor, group: ProcessGroup | None, what: str = "tp all-reduce") -> torch.Tensor:
    """Sum ``x`` over ``group`` into a new tensor (``what`` names it in a failure's CommError)."""
    out = x.contiguous().clone()
    if _size(group) > 1:
        collective(what, group, lambda: dist.all_reduce(out, group=group))
    return out


def all_gather(x: torch.Tensor, dim: int, group: ProcessGroup | None, what: str = "tp all-gather") -> torch.Tensor:
    """Concatenate the ranks' ``x`` along ``dim`` (rank order), contiguous (``what`` names it in a CommError).

    Contiguous because the consumers (the projections after SP's all-gather) flatten it: a strided result
    would be copied by each of them, and autograd would keep every copy (three for Q, K, V).
    """
    t = _size(group)
    if t == 1:
        return x
    x = x.movedim(dim, 0).contiguous()  # gather along the leading dim: one contiguous buffer
    out = x.new_empty((t * x.shape[0], *x.shape[1:]))
    collective(what, group, lambda: all_gather_tensor(out, x, group=group))
    return out.movedim(0, dim).contiguous()


def reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup | None,
                   what: str = "tp reduce-scatter") -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's slice of ``dim`` (``what`` names it in a CommError)."""
    t = _size(group)
    if t == 1:
        return x
    _check_divisible(x, dim, t)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // t, *x.shape[1:]))
    collective(what, group, lambda: reduce_scatter_tensor(out, x, group=group))
    return out.movedim(0, dim)


def split(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's slice of ``dim`` (no communication)."""
    t = _size(group)
    if t == 1:
        return x
    _check_divisible(x, dim, t)
    return x.chunk(t, dim=dim)[_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group, "tp all-reduce of input gradients (backward of f)"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group, "tp all-reduce of partial outputs (forward of g)")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AlongDim(torch.autograd.Function):
    """A collective along ``dim`` whose backward is its conjugate: ``fwd`` forward, ``bwd`` backward."""

    @staticmethod
    def forward(ctx, x, dim, group, fwd, bwd):
        ctx.dim, ctx.group, ctx.bwd = dim, group, bwd
        return fwd(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.bwd(grad, ctx.dim, ctx.group), None, None, None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return _CopyToTP.apply(x, group) if _size(group) > 1 else x


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group) if _size(group) > 1 else x


def gather_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-gather along the last dim forward, split backward: [.., H/t] -> [.., H]."""
    return _AlongDim.apply(x, x.dim() - 1, group, all_gather, split) if _size(group) > 1 else x


def scatter_last(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Split along the last dim forward, all-gather backward: [.., H] -> [.., H/t]."""
    return _AlongDim.apply(x, x.dim() - 1, group, split, all_gather) if _size(group) > 1 else x


def gather_seq(x: torch.Tensor, group: ProcessGroup | None, dim: int = 1,
               names: tuple[str, str] = ("tp all-gather", "tp reduce-scatter")) -> torch.Tensor:
    """SP's f: all-gather along the sequence forward, reduce-scatter backward: [B, S/t, H] -> [B, S, H]; ``names``:
    the two collectives' in a failure's CommError."""
    if _size(group) == 1:
        return x
    return _AlongDim.apply(x, dim, group, partial(all_gather, what=names[0]), partial(reduce_scatter, what=names[1]))


def reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """SP's g: reduce-scatter along the sequence forward, all-gather backward: [B, S, H] -> [B, S/t, H]."""
    return _AlongDim.apply(x, dim, group, reduce_scatter, all_gather) if _size(group) > 1 else x


def scatter_seq(x: torch.Tensor, group: ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """Split a replicated tensor along the sequence forward, all-gather backward: [B, S, H] -> [B, S/t, H]."""
    return _AlongDim.apply(x, dim, group, split, all_gather) if _size(group) > 1 else x
