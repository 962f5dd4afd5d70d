"""Split backward for zero-bubble schedules: the input-gradient pass (I) defers weight gradients to W.

Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2: a linear layer's backward is two matmuls,
dX = dY·A^T (needed by the previous stage now) and dA = X^T·dY (needed only by the optimizer). During
an I pass, linear layers routed through :func:`linear` compute dX and queue the dA product in a
:class:`WeightGradStore` under the current (chunk, micro-batch) key; the W pass runs the queue. Other
parameters (norms, embeddings) get their gradients in the I pass as usual: they are cheap.

A linear layer may keep its input for the weight gradient as something smaller (``KeptInput``): sequence
parallelism's projections keep their sequence shard and all-gather it again in the backward
(plait.tensor_parallel.regather).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

#: (the tensor a linear layer saves instead of its input, the function giving the input back from it in the backward)
KeptInput = tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]
_GRAD_SINK = "_plait_grad_sink"  # a parameter's mark: where its deferred weight gradients go


class WeightGradStore:
    """Queues of deferred weight-gradient computations, keyed by (chunk, micro-batch)."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None  # set while an I pass runs
        self.queues: dict[tuple[int, int], list[Callable[[], None]]] = {}

    @contextmanager
    def deferring(self, key: tuple[int, int]):
        """Inside, weight gradients of deferrable layers are queued under ``key`` instead of computed."""
        self.key = key
        self.queues.setdefault(key, [])
        try:
            yield
        finally:
            self.key = None

    def defer_or_run(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` while deferring, else run it now (for custom layers with their own backward)."""
        if self.key is None:
            fn()
        else:
            self.queues[self.key].append(fn)

    def flush(self, key: tuple[int, int]) -> int:
        """Run the weight-gradient work queued for ``key`` (the W action); returns how many ran."""
        queue = self.queues.pop(key, [])
        for fn in queue:
            fn()
        return len(queue)

    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())


def set_grad_sink(param: nn.Parameter, sink: Callable[[nn.Parameter, torch.Tensor], None]) -> None:
    """Hand ``param``'s deferred weight gradients to ``sink(param, grad)`` instead of adding them to ``.grad``
    (plait.data_parallel.reducer: into the bucket's float32 buffer)."""
    setattr(param, _GRAD_SINK, sink)


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    sink = getattr(param, _GRAD_SINK, None)
    if sink is not None:
        sink(param, grad)
    elif param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store, kept):
        ctx.save_for_backward(x if kept is None else kept[0], weight)
        ctx.restore = None if kept is None else kept[1]
        # the parameters themselves (saved tensors may come back as aliases, e.g. under checkpointing)
        ctx.store, ctx.has_bias, ctx.weight_param, ctx.bias_param = store, bias is not None, weight, bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out: [.., out]
        x, weight = ctx.saved_tensors
        if ctx.restore is not None:
            x = ctx.restore(x)
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None  # [.., in]
        store, has_bias = ctx.store, ctx.has_bias
        if store is None or store.key is None:
            grad_w = grad_out.flatten(0, -2).t() @ x.flatten(0, -2)  # [out, in]
            grad_b = grad_out.flatten(0, -2).sum(0) if has_bias else None
            return grad_x, grad_w, grad_b, None, None

        def weight_grad(w=ctx.weight_param, bias_param=ctx.bias_param, g=grad_out, inp=x):
            _accumulate(w, g.flatten(0, -2).t() @ inp.flatten(0, -2))
            if bias_param is not None:
                _accumulate(bias_param, g.flatten(0, -2).sum(0))

        store.defer_or_run(weight_grad)
        return grad_x, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: WeightGradStore | None,
           kept: KeptInput | None = None) -> torch.Tensor:
    """F.linear whose weight gradient can be deferred to a W pass (leaf weights only), and whose input can be kept
    for it as ``kept`` says (any weight)."""
    deferrable = store is not None and weight.requires_grad and weight.is_leaf and (bias is None or bias.is_leaf)
    if not deferrable and kept is None:
        return F.linear(x, weight, bias)
    return _DeferrableLinear.apply(x, weight, bias, store if deferrable else None, kept)


class DeferrableLinear(nn.Linear):
    """nn.Linear that routes through :func:`linear` (same parameters and state-dict keys)."""

    wgrad_store: WeightGradStore | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.wgrad_store)


def install(module: nn.Module, store: WeightGradStore) -> int:
    """Route every linear layer of ``module`` through ``store``; returns how many layers were set up."""
    count = 0
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.__class__ = DeferrableLinear
        if isinstance(sub, DeferrableLinear) or hasattr(sub, "wgrad_store"):
            setattr(sub, "wgrad_store", store)  # noqa: B010 (DeferrableLinear and TPShardedModule declare it)
            count += 1
    return count
