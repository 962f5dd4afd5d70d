"""Gradient reduction over data parallelism: contiguous fp32 bucket buffers, reduced while the backward runs.

A chunk's parameters are laid end to end in buckets (reverse parameter order, roughly the order backward
produces gradients; about ``bucket_mb`` each). Each bucket owns one float32 buffer ``[padded]`` that the
gradients accumulate into over the micro-batches: a float32 parameter's ``.grad`` is a view of it (autograd
accumulates in place), a lower-precision parameter's gradient is added into it and dropped (Megatron-LM's
``main_grad``). The buffer is padded to a multiple of its group's size ``g`` and cut into ``g`` equal shards;
member i of the group owns shard i (the layout of Megatron-LM's distributed optimizer; Rajbhandari et al.
2020, "ZeRO", §5.1-5.2).

At a chunk's last backward a bucket whose gradients are complete is reduced asynchronously, by mode:
- ``"all-reduce"`` (ZeRO-0): every member gets the whole sum;
- ``"reduce-scatter"`` (ZeRO-1): member i gets the sum of shard i, written into its shard of the buffer
  (the rest of the buffer then holds stale local values);
- ``"reduce-scatter-free"`` (ZeRO-2, ZeRO-3): the same, kept in a ``[shard]`` tensor, and the full buffer is
  freed: after the backward no rank holds a full gradient of a bucket. A bucket's launch first waits for the
  reduction launched before it (it has had a bucket's backward to finish), so at most one full buffer is in
  flight (FSDP's bound).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from plait.distributed.collectives import collective, reduce_scatter_tensor
from plait.distributed.context import ParallelContext
from plait.errors import ConfigError
from plait.weight_grad import set_grad_sink

MODES = ("all-reduce", "reduce-scatter", "reduce-scatter-free")
_GRAD_GROUP = "_plait_grad_group"  # a parameter's mark: (group, size) of its gradient's reduction


def weak_hook(method: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
    """``method`` as a parameter hook that does not keep its object alive. The garbage collector does not see
    the post-accumulate-grad hooks a tensor holds, so a hook bound to the reducer that holds the tensor would
    keep both, the model's parameters and the process groups of its buckets, alive until the process ends."""
    ref = weakref.WeakMethod(method)

    def hook(p: nn.Parameter) -> None:
        bound = ref()
        if bound is not None:
            bound(p)
    return hook


def set_grad_group(param: nn.Parameter, group: ProcessGroup | None, size: int) -> None:
    """Reduce ``param``'s gradient over ``group`` (of ``size`` ranks) instead of the DP group (e.g. experts)."""
    setattr(param, _GRAD_GROUP, (group, size))


def grad_group(param: torch.Tensor) -> tuple[ProcessGroup | None, int] | None:
    """The group ``set_grad_group`` gave ``param``'s gradient and its size; None: the DP group's."""
    return getattr(param, _GRAD_GROUP, None)


class Bucket:
    """Parameters laid end to end in one float32 gradient buffer, sharded over their reduction group."""

    def __init__(self, params: list[nn.Parameter], group: ProcessGroup | None, size: int, index: int):
        self.params, self.group, self.size, self.index = params, group, size, index
        self.offsets: list[int] = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.shard = math.ceil(n / size) if n else 0  # elements per member
        self.padded = self.shard * size
        self.lo, self.hi = index * self.shard, (index + 1) * self.shard  # this member's shard
        self.reduced: torch.Tensor | None = None  # [shard] after a reduce-scatter-free
        self.out: torch.Tensor | None = None      # [shard] reduce-scatter output in flight
        self.work = None
        self.launched = False
        self.ready: set[int] = set()
        # views of the buffer, made once per buffer (a step's hooks and readers share them: no slicing per use)
        self._views: list[torch.Tensor] = []
        self._shard: torch.Tensor | None = None
        self._zeroed = -1  # the buffer's ``_version`` right after it was last zeroed (-1: not known to be zero)
        self._buffer: torch.Tensor | None = None

    @property
    def buffer(self) -> torch.Tensor | None:
        """[padded] float32, while gradients accumulate (None when freed)."""
        return self._buffer

    @buffer.setter
    def buffer(self, t: torch.Tensor | None) -> None:
        if t is not self._buffer:  # the old buffer's views go with it (they would keep its memory alive)
            self._views, self._shard, self._zeroed = [], None, -1
        self._buffer = t

    def allocate(self) -> torch.Tensor:
        """The buffer, allocated zeroed if there is none."""
        if self.buffer is None:
            self.buffer = torch.zeros(self.padded, dtype=torch.float32, device=self.params[0].device)
            self._zeroed = self.buffer._version
        return self.buffer

    def views(self) -> list[torch.Tensor]:
        """Every parameter's slice of the buffer, shaped like it (allocates the zeroed buffer if needed)."""
        buffer = self.allocate()
        if self._shard is None:
            pairs = zip(self.params, self.offsets, strict=True)
            self._views = [buffer[o:o + p.numel()].view(p.shape) for p, o in pairs]
            self._shard = buffer[self.lo:self.hi]
        return self._views

    def view(self, i: int) -> torch.Tensor:
        """The buffer's slice of parameter i, shaped like it (allocates the zeroed buffer if needed)."""
        return self.views()[i]

    def own_shard(self) -> torch.Tensor:
        """This member's ``[shard]`` slice of the buffer (allocates the zeroed buffer if needed)."""
        self.views()
        assert self._shard is not None  # views() made it with the buffer's views
        return self._shard

    def written(self) -> None:
        """The buffer may have changed where its version counter does not see it (a collective writes into it)."""
        self._zeroed = -1

    def zero(self) -> None:
        """Zero the buffer unless nothing wrote to it since it was last zeroed (its version counter, which every
        in-place write through the buffer or a view of it advances, is unchanged; collectives call ``written``)."""
        if self.buffer is not None and self.buffer._version != self._zeroed:
            self.buffer.zero_()
            self._zeroed = self.buffer._version


def refuse_sharded_grads(reducers: Iterable[GradReducer], ctx: ParallelContext) -> None:
    """ConfigError if ``reducers`` keep each rank's shard of the reduced gradients only (ZeRO-1 or ZeRO-2 over more
    than one rank): no rank then holds the model's gradients whole. Decided by the mode and the layout, so every
    rank decides alike, before any collective."""
    sharded = {r.mode for r in reducers} - {"all-reduce"}
    if sharded and max(ctx.dp_cp_size, ctx.expert_dp_size) > 1:
        zero = 1 if sharded == {"reduce-scatter"} else 2
        raise ConfigError(f"full_state_dict(grads=True) with a ZeRO-{zero} optimizer: after train_step each data-"
                          "parallel rank holds the sum of its own shard of the gradients only (the rest of the buffer "
                          "is stale), so no rank has them whole; make the optimizer with zero=0 to read whole "
                          "gradients (a ZeRO optimizer's grad_norm() and step() read the shards)")


class GradReducer:
    """Accumulates and reduces the gradients of ``params`` (one pipeline chunk) in buckets.

    ``alone``: ids of parameters that get a bucket of their own (tied copies on several pipeline ranks:
    their shards then line up across the tie group). Parameters marked by ``set_grad_group`` go over their
    own group; the others over ``ctx``'s dp×cp group (the DP group without context parallelism: CP ranks
    see different tokens of the same rows, so their gradients are summed too). Groups of one rank reduce
    nothing.
    ``units`` (ZeRO-3, ``param_shards``): lists of parameters that each make one bucket per reduction group,
    whatever their size, instead of ~``bucket_mb`` buckets (``params`` is then ignored).
    """

    def __init__(self, params: list[nn.Parameter], ctx: ParallelContext, *, bucket_mb: float = 25.0,
                 alone: frozenset[int] = frozenset(), units: list[list[nn.Parameter]] | None = None):
        self.ctx, self.mode, self.armed = ctx, "all-reduce", False
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[Bucket, int]] = {}
        for unit in units or []:
            for group, size, members in self._by_group(unit, frozenset()).values():
                self._add(members, group, size)
        for group, size, members in (self._by_group(params, alone).values() if units is None else ()):
            self._fill(members, group, size, int(bucket_mb * 2**20))
        on_grad = weak_hook(self._on_grad)
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
                p.register_post_accumulate_grad_hook(on_grad)
                set_grad_sink(p, self.accumulate)  # the W pass's deferred weight gradients go into the bucket

    def _by_group(self, params: list[nn.Parameter], alone: frozenset[int]) -> dict[int, tuple]:
        """Trainable ``params`` by reduction group (``alone`` ones get their bucket at once)."""
        by_group: dict[int, tuple[object, int, list[nn.Parameter]]] = {}
        for p in params:  # most go over DP; set_grad_group redirects some (experts: expert-DP group)
            if not p.requires_grad:
                continue
            group, size = grad_group(p) or (self.ctx.dp_cp_group, self.ctx.dp_cp_size)
            if id(p) in alone:
                self._add([p], group, size)
            else:
                by_group.setdefault(id(group), (group, size, []))[2].append(p)
        return by_group

    def bucket_of(self, p: nn.Parameter) -> Bucket:
        return self._where[id(p)][0]

    def _add(self, params: list[nn.Parameter], group, size: int) -> None:
        index = dist.get_group_rank(group, self.ctx.rank) if size > 1 else 0
        self.buckets.append(Bucket(params, group, max(size, 1), index))

    def _fill(self, params: list[nn.Parameter], group, size: int, cap: int) -> None:
        current: list[nn.Parameter] = []
        nbytes = 0
        for p in reversed(params):
            current.append(p)
            nbytes += p.numel() * 4
            if nbytes >= cap:
                self._add(current, group, size)
                current, nbytes = [], 0
        if current:
            self._add(current, group, size)

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ConfigError(f"gradient reduction mode {mode!r}: use one of {', '.join(MODES)}")
        self.mode = mode

    # ------------------------------------------------------------------------------ accumulation
    def _absorb(self, p: nn.Parameter) -> None:
        """Move ``p.grad`` into the bucket buffer unless it already is the buffer's view."""
        b, i = self._where[id(p)]
        g = p.grad
        if g is None:
            return
        view = b.view(i)
        if g.data_ptr() != view.data_ptr():
            with torch.no_grad():
                view.add_(g)
            p.grad = view if p.dtype == view.dtype else None

    @torch.no_grad()
    def accumulate(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        """Add ``grad`` to ``p``'s gradient (the weight-gradient pass of zero-bubble schedules)."""
        self._absorb(p)
        b, i = self._where[id(p)]
        view = b.view(i)
        view.add_(grad)
        if p.dtype == view.dtype:
            p.grad = view

    def take(self, b: Bucket, grads: Sequence[torch.Tensor | None]) -> None:
        """Add the gradients of ``b``'s parameters (in order; None: none, any floating dtype) into its buffer (one
        add each, in float32), as a backward pass produces them; the bucket is complete then (plait.optim.precision:
        the backward of a bucket's cast node, or the hook on its leaf copies). Float32 parameters get their views as
        ``.grad``."""
        views = b.views()
        pairs = [(v, g) for v, g in zip(views, grads, strict=True) if g is not None]
        with torch.no_grad():
            torch._foreach_add_([v for v, _ in pairs], [g for _, g in pairs])
        for p, v in zip(b.params, views, strict=True):
            if p.grad is None and p.dtype == v.dtype:
                p.grad = v
        if self.armed and not b.launched:
            self._launch(b)

    def _on_grad(self, p: nn.Parameter) -> None:
        self._absorb(p)
        if not self.armed:
            return
        b, _ = self._where[id(p)]
        b.ready.add(id(p))
        if len(b.ready) == len(b.params) and not b.launched:
            self._launch(b)
        if self.mode == "reduce-scatter-free":  # free the full buffers of finished reductions early
            for done in self.buckets:
                if done.work is not None and done.work.is_completed():
                    self._settle(done)

    # --------------------------------------------------------------------------------- reduction
    def arm(self) -> None:
        """Reduce buckets as soon as they are complete during the next backward passes."""
        self.armed = True
        for b in self.buckets:
            b.ready.clear()

    def _launch(self, b: Bucket) -> None:
        b.launched = True
        # gradients written past the hooks (a missing one counts as zeros); the hooks absorbed the ready ones
        for p, view in zip(b.params, b.views(), strict=True):
            g = p.grad
            if g is not None and g is not view and id(p) not in b.ready:
                self._absorb(p)
        buffer = b.allocate()
        b.written()
        if self.mode == "all-reduce":
            if b.size > 1:
                b.work = dist.all_reduce(buffer, group=b.group, async_op=True)
            return
        if self.mode == "reduce-scatter-free":  # at most one full buffer in flight: the one launched before
            for done in self.buckets:  # has had this bucket's backward to finish; its buffer goes now
                if done.work is not None:
                    self._settle(done)
        if b.size > 1:
            b.out = torch.empty(b.shard, dtype=buffer.dtype, device=buffer.device)
            b.work = reduce_scatter_tensor(b.out, buffer, group=b.group, async_op=True)
        else:
            b.out = buffer

    def wait_for(self, b: Bucket, op: str) -> None:
        """Wait for ``b``'s reduction in flight, if any (``op``: "all-reduce" or "reduce-scatter"); a peer that
        died or went silent ends it in a CommError naming the reduction and its group's ranks."""
        if b.work is not None:
            who = "dp" if b.group is self.ctx.dp_cp_group else "expert-dp"
            work = b.work
            collective(lambda: f"{who} {op} of gradients (bucket of {len(b.params)} tensors)", b.group, work.wait)
            b.work = None

    def _settle(self, b: Bucket) -> None:
        """Wait for ``b``'s reduction and put the result in place (see the modes)."""
        self.wait_for(b, "all-reduce" if self.mode == "all-reduce" else "reduce-scatter")
        if self.mode == "all-reduce" or b.out is None:
            return
        out, b.out = b.out, None
        if self.mode == "reduce-scatter":
            if out is not b.buffer:
                assert b.buffer is not None
                b.buffer[b.lo:b.hi].copy_(out)
            return
        b.reduced, b.buffer = out, None
        for p in b.params:  # they viewed the freed buffer
            p.grad = None

    def launch_pending(self) -> None:
        """Start the reduction of every bucket not yet started (a missing gradient counts as zeros)."""
        for b in self.buckets:
            if not b.launched:
                self._launch(b)
        self.armed = False

    def finish(self) -> None:
        """Launch what is left, wait for every bucket and put the results in place."""
        self.launch_pending()
        for b in self.buckets:
            self._settle(b)
            b.launched = False
        self.armed = False

    def zero_grad(self) -> None:
        """Forget this step's gradients (buffers are zeroed, kept under all-reduce / reduce-scatter)."""
        for b in self.buckets:
            b.zero()
            b.reduced = b.out = b.work = None
            b.launched = False
            b.ready.clear()
            for p in b.params:
                p.grad = None
        self.armed = False

    def point_grads(self) -> None:
        """Before a step: float32 parameters of buckets that kept their (zeroed) buffer get its views as
        ``.grad``, so autograd accumulates in place from the first micro-batch on."""
        for b in self.buckets:
            if b.buffer is not None:
                for p, view in zip(b.params, b.views(), strict=True):
                    if p.dtype == view.dtype:
                        p.grad = view

    # ----------------------------------------------------------------------------------- reading
    def shard(self, b: Bucket) -> torch.Tensor:
        """This member's reduced shard of ``b``: [shard] (after ``finish``)."""
        return b.reduced if b.reduced is not None else b.own_shard()

    def region(self, b: Bucket) -> tuple[int, torch.Tensor]:
        """(start, tensor): the part of ``b``'s flat gradient that holds reduced values on this rank."""
        if self.mode == "all-reduce":
            return 0, b.allocate()
        return b.lo, self.shard(b)

    def pieces(self, wanted: Callable[[nn.Parameter], bool]) -> list[torch.Tensor]:
        """The valid, reduced gradient elements of every parameter ``p`` with ``wanted(p)``, as flat views
        (in bucket order: the same list on every rank with the same bucket layout, e.g. the TP group)."""
        out = []
        for b in self.buckets:
            chosen = [i for i, p in enumerate(b.params) if wanted(p)]
            if not chosen:
                continue
            start, t = self.region(b)
            for i in chosen:
                lo = max(b.offsets[i], start)
                hi = min(b.offsets[i] + b.params[i].numel(), start + t.numel())
                if hi > lo:
                    out.append(t[lo - start:hi - start])
        return out

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every gradient tensor this reducer holds right now (buffers and reduced shards)."""
        return [t for b in self.buckets for t in (b.buffer, b.reduced, b.out) if t is not None]
