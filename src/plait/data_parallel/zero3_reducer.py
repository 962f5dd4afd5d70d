"""ZeRO-3's gradient reduction: a block's gradients reduce-scattered straight from autograd's ``.grad`` tensors as
soon as they are complete, in every backward pass, and summed into this member's ``[shard]``.

The buckets are ``data_parallel.reducer``'s (one per block and reduction group, padded and cut into ``d`` equal
shards: Rajbhandari et al. 2020, "ZeRO", §5.3), but no full ``[padded]`` gradient buffer waits for them:
autograd keeps each parameter's gradient in its own ``.grad`` (it hands over the tensor it computed, no copy)
until the bucket's last parameter has its gradient. Then
1. ``before_launch(bucket)`` runs (``param_shards`` frees the block's gathered parameters: nothing reads them
   again in this backward, and a later forward gathers them again),
2. the reduction launched before it is waited for and its input freed (at most one full input in flight),
3. a ``[padded]`` float32 input is filled from the ``.grad`` tensors, each dropped once copied (a missing one
   counts as zeros), and its reduce-scatter starts asynchronously; its ``[shard]`` result is added to
   ``reduced`` when waited for.
A bucket's first gradient waits for the reduction in flight (it has had the start of this block's backward to
run) and then calls ``on_first_grad(bucket)`` (``param_shards`` issues the next gather there): a block's
backward never holds its gradients beside the previous block's input, and one collective is in flight at a
time; the next micro-batch's forward waits for the last one (``settle_in_flight``). As FSDP does, each
micro-batch's gradients are reduce-scattered by its own backward and accumulated sharded (1/d), never kept
whole across micro-batches; what a micro-batch left incomplete (a parameter it did not use) stays in ``.grad``
and goes with the bucket's next launch, at the latest at ``finish``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait.data_parallel.reducer import Bucket, GradReducer
from plait.distributed.collectives import reduce_scatter_tensor
from plait.distributed.context import ParallelContext
from plait.errors import ConfigError
from plait.parallel_config import ZERO3_SCHEDULES


class Zero3Reducer(GradReducer):
    """Reduce-scatters each block's gradients (``units``: the parameters of each block) from ``.grad`` as soon as
    they are complete, every backward; ``shard(b)`` is the sum over the step's backward passes."""

    def __init__(self, units: list[list[nn.Parameter]], ctx: ParallelContext):
        super().__init__([], ctx, units=units)
        self.mode = "reduce-scatter-free"
        self.before_launch: Callable[[Bucket], None] | None = None  # set by param_shards: free the gathered block
        self.on_first_grad: Callable[[Bucket], None] | None = None  # param_shards: prefetch the next block
        self.on_finish: Callable[[], None] | None = None  # param_shards: the shards' .grad are the reduced shards
        self.in_flight: Bucket | None = None

    def set_mode(self, mode: str) -> None:
        if mode != "reduce-scatter-free":
            raise ConfigError(f"gradient reduction {mode!r}: a model with ZeRO-3 sharded parameters reduce-scatters "
                              "(reduce-scatter-free)")

    def arm(self) -> None:
        """Nothing to do: every backward reduces its buckets as they complete."""

    def _on_grad(self, p: nn.Parameter) -> None:
        b, _ = self._where[id(p)]
        if not b.ready:
            self.settle_in_flight()
            if self.on_first_grad is not None:
                self.on_first_grad(b)
        b.ready.add(id(p))
        if len(b.ready) == len(b.params):
            self._launch(b)

    @torch.no_grad()
    def _launch(self, b: Bucket) -> None:
        if self.before_launch is not None:
            self.before_launch(b)
        self.settle_in_flight()
        device = b.params[0].device
        flat = torch.empty(b.padded, dtype=torch.float32, device=device)  # [padded]
        for p, off in zip(b.params, b.offsets, strict=True):
            piece = flat[off:off + p.numel()]
            if p.grad is None:
                piece.zero_()
            else:
                piece.copy_(p.grad.reshape(-1))
                p.grad = None  # freed now: the input holds it
        flat[b.numel:].zero_()
        b.ready.clear()
        b.launched = True  # gradients of this step went into a reduction (finish: zeros if none ever did)
        if b.size == 1:
            b.buffer, b.out = flat, flat
        else:
            b.buffer, b.out = flat, torch.empty(b.shard, dtype=torch.float32, device=device)
            b.work = reduce_scatter_tensor(b.out, flat, group=b.group, async_op=True)
        self.in_flight = b

    def _settle(self, b: Bucket) -> None:
        self.wait_for(b, "reduce-scatter")
        if b.out is not None:
            if b.reduced is None:
                b.reduced = b.out
            else:
                b.reduced.add_(b.out)
        b.out = b.buffer = None
        if self.in_flight is b:
            self.in_flight = None

    def settle_in_flight(self) -> None:
        """Wait for the reduction in flight, if any, and free its input."""
        if self.in_flight is not None:
            self._settle(self.in_flight)

    def launch_pending(self) -> None:
        """Launch every bucket that holds gradients not yet reduced (parameters some micro-batch did not use)."""
        for b in self.buckets:
            if b.ready or any(p.grad is not None for p in b.params):
                self._launch(b)

    def finish(self) -> None:
        """Launch what is left and wait for it; a bucket that saw no gradient this step reduces to zeros."""
        self.launch_pending()
        self.settle_in_flight()
        for b in self.buckets:
            if b.reduced is None:
                b.reduced = torch.zeros(b.shard, dtype=torch.float32, device=b.params[0].device)
            b.launched = False
            b.ready.clear()
        if self.on_finish is not None:
            self.on_finish()

    def zero_grad(self) -> None:
        self.settle_in_flight()
        super().zero_grad()

    def accumulate(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        raise ConfigError("zero=3 runs without split backward passes (weight-gradient passes): use one of "
                          f"{', '.join(ZERO3_SCHEDULES)}")

    def grad_tensors(self) -> list[torch.Tensor]:
        return [t for b in self.buckets for t in (b.buffer, b.reduced, b.out) if t is not None]
