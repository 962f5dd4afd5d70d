"""Megatron-style tensor-parallel layers: column/row parallel linear, vocabulary-parallel embedding.

Each layer knows how its parameters are sharded (``shard_dims``), so full tensors can be gathered
(``full_tensor``) and loaded (``load_full``) without the model knowing anything about parallelism.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from plait.distributed.context import ParallelContext
from plait.errors import ConfigError, divisors
from plait.tensor_parallel import comms
from plait.tensor_parallel.regather import kept_input
from plait.weight_grad import linear


def mark_tp_partial(param: torch.Tensor) -> None:
    """Flag a replicated parameter whose gradient on each TP rank is only a partial sum (summed later)."""
    setattr(param, "_plait_tp_partial", True)  # noqa: B010 (read by sync_tp_partial_grads)


def new_param(t: torch.Tensor) -> nn.Parameter:
    """A parameter holding a copy of ``t`` (a slice of a dense layer's tensor). On the meta device only the
    shape is kept: copying a meta tensor (like concatenating one) imports PyTorch's symbolic-shape machinery,
    seconds of start-up per process for nothing."""
    if t.is_meta:
        return nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device="meta"))
    return nn.Parameter(t.detach().clone())


def is_tp_partial(param: torch.Tensor) -> bool:
    return getattr(param, "_plait_tp_partial", False)


def sync_tp_partial_grads(params, ctx: ParallelContext) -> None:
    """Sum the partial gradients of TP-replicated parameters (SP norms and biases, replicated KV) over TP."""
    sum_over_tp([p.grad for p in params if is_tp_partial(p) and p.grad is not None], ctx)


def sum_over_tp(grads: list[torch.Tensor], ctx: ParallelContext) -> None:
    """All-reduce (sum) ``grads`` in place over TP, as one flat message (the same list on every TP rank)."""
    if ctx.tp_size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=ctx.tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class TPShardedModule(nn.Module):
    """Base for layers whose parameters are slices of a full tensor along one dimension."""

    ctx: ParallelContext
    #: parameter name -> (dimension it is sharded on or None if replicated, full size on that dimension)
    shard_dims: dict[str, tuple[int | None, int]]
    #: set by the pipeline runtime for zero-bubble schedules (weight gradients deferred to W passes)
    wgrad_store = None

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """All-gather ``local`` (this parameter or its gradient) over TP into the full tensor."""
        dim, full = self.shard_dims[name]
        if dim is None or self.ctx.tp_size == 1:
            return local.detach().clone()
        gathered = comms.all_gather(local.detach(), dim, self.ctx.tp_group)
        return gathered.narrow(dim, 0, full).clone()

    def full_shape(self, name: str, local: torch.Tensor) -> tuple[int, ...]:
        """The shape of the full tensor whose shard this rank holds as ``local`` (parameter ``name``)."""
        dim, size = self.shard_dims[name]
        shape = list(local.shape)
        if dim is not None:
            shape[dim] = size
        return tuple(shape)

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full tensor (zero-padded to a multiple of tp)."""
        dim, size = self.shard_dims[name]
        if dim is None:
            return full
        if full.shape[dim] != size:
            raise ConfigError(f"{name}: expected size {size} on dim {dim}, got shape {tuple(full.shape)}")
        t, r = self.ctx.tp_size, self.ctx.tp_rank
        padded = math.ceil(size / t) * t
        if full.is_meta:  # the shard's shape only (see new_param)
            shape = list(full.shape)
            shape[dim] = padded // t
            return torch.empty(shape, dtype=full.dtype, device="meta")
        if padded != size:
            pad_shape = list(full.shape)
            pad_shape[dim] = padded - size
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
        return full.chunk(t, dim=dim)[r]

    @torch.no_grad()
    def load_full(self, name: str, full: torch.Tensor) -> None:
        getattr(self, name).copy_(self.shard_of(name, full.to(getattr(self, name).dtype)))


def _check_divisible(value: int, name: str, ctx: ParallelContext, what: str) -> None:
    if value % ctx.tp_size:
        valid = [t for t in divisors(value) if t <= 64]
        raise ConfigError(f"tp={ctx.tp_size} does not divide {what} {name}={value}; valid tp: {valid}")


class ColumnParallelLinear(TPShardedModule):
    """Y = X A with A split by columns: each rank computes X A_i ([.., out/t]); no forward communication.

    ``input_comm=False`` skips the input collective when an enclosing region already did it (one ``f``
    for Q, K and V together).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, ctx: ParallelContext,
                 gather_output: bool = False, sequence_parallel: bool = False, input_comm: bool = True,
                 dtype: torch.dtype | None = None):
        super().__init__()
        _check_divisible(out_features, "out_features", ctx, "the output size")
        self.ctx, self.in_features, self.out_features = ctx, in_features, out_features
        self.gather_output, self.sequence_parallel, self.input_comm = gather_output, sequence_parallel, input_comm
        dense = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)  # same RNG use as the dense layer
        self.shard_dims = {"weight": (0, out_features), "bias": (0, out_features)}
        self.weight = new_param(self.shard_of("weight", dense.weight.detach()))  # [out/t, in]
        self.bias = new_param(self.shard_of("bias", dense.bias.detach())) if bias else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, ctx: ParallelContext, **kw) -> ColumnParallelLinear:
        layer = cls.__new__(cls)
        TPShardedModule.__init__(layer)
        layer.ctx, layer.in_features, layer.out_features = ctx, linear.in_features, linear.out_features
        layer.gather_output = kw.pop("gather_output", False)
        layer.sequence_parallel = kw.pop("sequence_parallel", False)
        layer.input_comm = kw.pop("input_comm", True)
        pad_output = kw.pop("pad_output", False)  # a vocabulary head: pad rows to a multiple of tp
        if kw:
            raise TypeError(f"unexpected arguments {sorted(kw)}")
        if not pad_output:
            _check_divisible(linear.out_features, "out_features", ctx, "the output size")
        layer.shard_dims = {"weight": (0, linear.out_features), "bias": (0, linear.out_features)}
        layer.weight = new_param(layer.shard_of("weight", linear.weight.detach()))
        has_bias = linear.bias is not None
        layer.bias = new_param(layer.shard_of("bias", linear.bias.detach())) if has_bias else None
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, S, in] (or [B, S/t, in] with SP)
        group = self.ctx.tp_group
        if self.input_comm:
            x = comms.gather_seq(x, group) if self.sequence_parallel else comms.copy_to_tp(x, group)
        # an SP region's gathered input is kept as its shard (plait.tensor_parallel.regather)
        y = linear(x, self.weight, self.bias, self.wgrad_store, kept_input(x))  # [B, S, out/t]
        return comms.gather_last(y, group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}/{self.ctx.tp_size}, sp={self.sequence_parallel}"


class RowParallelLinear(TPShardedModule):
    """Y = X A with A split by rows: each rank computes X_i A_i, then an all-reduce (or reduce-scatter)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, ctx: ParallelContext,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None):
        super().__init__()
        dense = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
        self._setup(dense, ctx, input_is_parallel, sequence_parallel)

    def _setup(self, dense: nn.Linear, ctx: ParallelContext, input_is_parallel: bool, sp: bool,
               reduce_output: bool = True) -> None:
        _check_divisible(dense.in_features, "in_features", ctx, "the input size")
        self.ctx, self.in_features, self.out_features = ctx, dense.in_features, dense.out_features
        self.input_is_parallel, self.sequence_parallel, self.reduce_output = input_is_parallel, sp, reduce_output
        self.shard_dims = {"weight": (1, dense.in_features), "bias": (None, dense.out_features)}
        self.weight = new_param(self.shard_of("weight", dense.weight.detach()))  # [out, in/t]
        self.bias = new_param(dense.bias) if dense.bias is not None else None
        if self.bias is not None and sp:
            mark_tp_partial(self.bias)  # added on a sequence shard: each rank sees part of the tokens

    @classmethod
    def from_dense(cls, linear: nn.Linear, ctx: ParallelContext, *, input_is_parallel: bool = True,
                   sequence_parallel: bool = False, reduce_output: bool = True) -> RowParallelLinear:
        """``reduce_output=False`` returns the TP partial sums (the caller reduces once, e.g. MoE experts)."""
        if not reduce_output and linear.bias is not None:
            raise ConfigError("reduce_output=False needs a linear layer without bias")
        layer = cls.__new__(cls)
        TPShardedModule.__init__(layer)
        layer._setup(linear, ctx, input_is_parallel, sequence_parallel, reduce_output)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, S, in/t]
        group = self.ctx.tp_group
        if not self.input_is_parallel:
            x = comms.scatter_last(x, group)
        y = linear(x, self.weight, None, self.wgrad_store)  # [B, S, out] partial sums
        if not self.reduce_output:
            return y
        y = comms.reduce_scatter_seq(y, group) if self.sequence_parallel else comms.reduce_from_tp(y, group)
        return y + self.bias if self.bias is not None else y  # [B, S/t or S, out]

    def extra_repr(self) -> str:
        return f"in={self.in_features}/{self.ctx.tp_size}, out={self.out_features}, sp={self.sequence_parallel}"


class VocabParallelEmbedding(TPShardedModule):
    """Embedding split along the vocabulary (padded to a multiple of tp); out-of-range ids give zeros, summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, ctx: ParallelContext,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        dense = nn.Embedding(num_embeddings, embedding_dim, dtype=dtype)
        self._setup(dense, ctx, sequence_parallel)

    def _setup(self, dense: nn.Embedding, ctx: ParallelContext, sp: bool) -> None:
        self.ctx, self.num_embeddings, self.embedding_dim = ctx, dense.num_embeddings, dense.embedding_dim
        self.sequence_parallel = sp
        self.shard_dims = {"weight": (0, dense.num_embeddings)}
        self.weight = new_param(self.shard_of("weight", dense.weight.detach()))  # [Vp/t, H]
        self.per_rank = self.weight.shape[0]
        self.vocab_start = ctx.tp_rank * self.per_rank

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, ctx: ParallelContext, *,
                   sequence_parallel: bool = False) -> VocabParallelEmbedding:
        layer = cls.__new__(cls)
        TPShardedModule.__init__(layer)
        layer._setup(embedding, ctx, sequence_parallel)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [B, S]
        group = self.ctx.tp_group
        if self.ctx.tp_size == 1:
            out = F.embedding(ids, self.weight)
        else:
            local = ids - self.vocab_start
            outside = (local < 0) | (local >= self.per_rank)
            out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [B, S, H] partial
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            if self.ctx.tp_size == 1:
                return out
            return comms.reduce_scatter_seq(out, group)  # [B, S/t, H]
        return comms.reduce_from_tp(out, group)  # [B, S, H]

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings} ({self.per_rank}/rank), dim={self.embedding_dim}"
