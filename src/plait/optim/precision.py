"""Mixed precision for a ParallelModel: bf16 weights and activations per step over fp32 master parameters.

The chunks keep their parameters in float32: they are the master weights (Micikevicius et al. 2018,
"Mixed Precision Training", §3.1). While a step runs, every floating-point parameter is replaced by
one bf16 copy (``p.to(bf16)``, made once per step and shared by all micro-batches), so matmuls,
activations and pipeline messages are bf16. The copies are a differentiable cast. The parameters of one
gradient bucket (``route``) are cast by one autograd node whose backward adds their bf16 gradients into the
bucket's float32 buffer (``GradReducer.take``: one add per gradient, float32 arithmetic, no float32 copy of
it and no per-parameter accumulation node); a bucket reduced over other ranks gets leaf copies instead, handed
to the buffer as soon as they are complete, so its reduction overlaps the backward; any other parameter's copy
is ``p.to(bf16)``, whose backward turns the gradient back into float32 for autograd to accumulate into
``.grad``. Either way micro-batch accumulation, the data-parallel reduction, the TP-partial sync and the tied
embedding sync all run in float32 without any change to that code.

Costs: 4 (fp32 master) + 2 (bf16 copy while a step runs) + 4 (fp32 grad) bytes per parameter.
Zero-bubble schedules stay correct but compute weight gradients in the I pass (the bf16 copy is not a
leaf, so ``plait.weight_grad.linear`` does not defer it).

Under a ZeRO optimizer (``ParallelOptimizer(zero=1|2)``) the fp32 masters move into the optimizer, sharded
over data parallelism, and the parameters themselves are stored in bf16 (``set_storage``): no per-step copy,
2 B per parameter, and the weight gradients are deferred again (the parameters are leaves).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import TypeVar, cast

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.hooks import RemovableHandle

from plait.errors import ConfigError

T = TypeVar("T")
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r}: use one of {sorted(PRECISIONS)}")
    return precision


class _Holder(nn.Module):
    """All of a rank's chunks under one root, so one ``functional_call`` swaps every parameter."""

    def __init__(self, chunks: Mapping[int, nn.Module]):
        super().__init__()
        self.chunks = nn.ModuleDict({str(c): m for c, m in chunks.items()})

    def forward(self, fn: Callable[[], object]) -> object:
        return fn()


_REQUIRES_GRAD = attrgetter("requires_grad")
#: takes the low-precision gradients of a group of parameters (in the group's order; None: no gradient)
GradSink = Callable[[Sequence[torch.Tensor | None]], None]


class _CastGroup(torch.autograd.Function):
    """Low-precision copies of a group of parameters; their gradients go to the group's sink, not to ``.grad``.

    The parameters come in a list, which autograd does not look into: the graph gets no edge (no accumulation
    node, no post-accumulate hook) per parameter. ``anchor`` (a scalar leaf that requires grad, which gets no
    gradient) makes the copies require grad."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, sink: GradSink, params: list[torch.Tensor], anchor: torch.Tensor):
        ctx.sink = sink
        ctx.set_materialize_grads(False)  # a copy the backward did not reach gives None, not zeros
        return tuple([p.to(dtype) for p in params])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.sink(grads)
        return None, None, None, None


def _early_copies(params: list[nn.Parameter], dtype: torch.dtype,
                  sink: GradSink) -> tuple[list[torch.Tensor], RemovableHandle]:
    """Leaf low-precision copies of ``params`` whose gradients go to ``sink`` once a backward has produced all of
    those it will (one call per backward, None for a copy it did not reach), and the hook's handle. Autograd also
    keeps each in the copy's ``.grad``: the hook drops those kept before it ran; the one kept after it (the copy
    whose gradient completed the set) is dropped by the next backward's hook or when the step ends
    (``StepCast.run``). The step's end also removes the hook: it and the copies' gradient accumulators hold each
    other through autograd's C++ side, where the garbage collector does not look, so a hook left in place would
    keep the copies and the sink alive until the process ends."""
    copies = [p.detach().to(dtype).requires_grad_() for p in params]

    def hand_over(grads: Sequence[torch.Tensor | None]) -> None:
        sink(grads)
        for c in copies:
            c.grad = None

    return copies, torch.autograd.graph.register_multi_grad_hook(copies, hand_over, mode="all")


class StepCast:
    """Runs a function with the chunks' fp32 parameters swapped for per-step low-precision copies."""

    def __init__(self, chunks: Mapping[int, nn.Module], precision: str = "fp32"):
        self.holder = _Holder(chunks)
        self.precision = check_precision(precision)
        self.stored: torch.dtype = torch.float32  # dtype the parameters are kept in
        self.copies: dict[str, torch.Tensor] = {}  # the low-precision copies while ``run`` runs
        # every parameter name (tied names too) with its parameter: the chunks' parameters are fixed once built
        self.named = list(self.holder.named_parameters(remove_duplicate=False))
        self.groups: list[tuple[list[nn.Parameter], GradSink]] = []  # ``route``
        self._anchors: dict[torch.device, torch.Tensor] = {}  # per device: the routed copies' edge into autograd
        self.early: frozenset[int] = frozenset()  # ``route``
        self._leaves: list[torch.Tensor] = []  # this step's early copies (their last ``.grad`` dropped at its end)
        self._hooks: list[RemovableHandle] = []  # their hooks (removed at the step's end)

    def route(self, groups: list[tuple[list[nn.Parameter], GradSink]], early: frozenset[int] = frozenset()) -> None:
        """Cast each group's parameters by one node whose backward hands their gradients to the group's sink
        (a gradient bucket: ``GradReducer.take``) instead of accumulating each into its ``.grad``.

        Autograd runs the newest ready node first, and that node is made before the forward, so it runs after
        the chunk's whole backward. The groups whose index is in ``early`` (buckets reduced over other ranks,
        whose reduction should start as soon as they are complete) get leaf copies instead, handed to the sink
        by one multi-gradient hook as soon as the backward has produced all of them (a leaf's accumulation
        runs as soon as it is ready)."""
        self.groups, self.early = groups, early

    def set(self, precision: str) -> None:
        check_precision(precision)
        if self.stored != torch.float32 and PRECISIONS[precision] != self.stored:
            raise ConfigError(f"precision={precision!r}: the parameters are stored in {self.stored} (a ZeRO "
                              "optimizer keeps the fp32 master weights); build a new model to change it")
        self.precision = precision

    def set_gathered(self, precision: str) -> None:
        """ZeRO-3: the parameters are gathered in the compute dtype for every use; no per-step copy."""
        self.precision = check_precision(precision)
        self.stored = self.dtype or torch.float32

    def set_storage(self, dtype: torch.dtype) -> None:
        """The parameters are now kept in ``dtype``: no per-step copy is needed when it is the compute dtype."""
        self.stored = dtype

    @property
    def dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.precision]

    def _copies(self) -> dict[str, torch.Tensor]:
        """Full parameter names -> one cast copy per distinct parameter (tied names share it)."""
        dtype = self.dtype
        assert dtype is not None  # ``run`` copies only to a low precision
        casts: dict[int, torch.Tensor] = {}
        for i, (params, sink) in enumerate(self.groups if torch.is_grad_enabled() else ()):
            # the run casts float32-stored parameters; one a user froze since keeps its plain cast (no gradient)
            if not all(map(_REQUIRES_GRAD, params)):
                continue
            if i in self.early:
                copies, hook = _early_copies(params, dtype, sink)
                self._leaves += copies
                self._hooks.append(hook)
            else:
                anchor = self._anchors.get(params[0].device)
                if anchor is None:
                    anchor = self._anchors[params[0].device] = torch.zeros((), device=params[0].device,
                                                                          requires_grad=True)
                copies = _CastGroup.apply(dtype, sink, params, anchor)
            casts.update(zip(map(id, params), copies, strict=True))
        out: dict[str, torch.Tensor] = {}
        for name, p in self.named:
            if not p.is_floating_point():
                continue
            if id(p) not in casts:
                casts[id(p)] = p.to(dtype)  # differentiable: grads flow back in fp32
            out[name] = casts[id(p)]
        return out

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` with low-precision parameters (or directly in fp32). Every name of a tied parameter is
        given its one copy, so ``functional_call`` need not look for ties itself."""
        if self.dtype is None or self.dtype == self.stored:
            return fn()
        self.copies = self._copies()
        try:
            return cast(T, functional_call(self.holder, self.copies, (fn,), strict=False, tie_weights=False))
        finally:
            for leaf in self._leaves:
                leaf.grad = None
            for hook in self._hooks:
                hook.remove()
            self.copies, self._leaves, self._hooks = {}, [], []
