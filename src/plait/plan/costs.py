"""The cost-model seam: what a pipeline chunk costs per micro-batch, and the protocol a cluster's cost model keeps.

A ``Cluster`` chooses its cost model once, when it is built: catalogue GPUs from their datasheets
(``plan.gpu.GpuCosts``) or a host ``plait calibrate`` measured (``plan.host.costs.HostCosts``).
``plan.estimate``, ``plan.search``, ``plan.timing`` and ``plan.step_end`` ask it, never which one it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from plait.plan.accumulation import RUNTIME_ACCUMULATION
from plait.plan.config import TE_OVERLAP_SMS
from plait.plan.eager import ELEMENTWISE
from plait.plan.optimizers import RUNTIME_OPTIMIZER

if TYPE_CHECKING:
    from plait.plan.config import Layout
    from plait.plan.documents import DocumentLengths
    from plait.plan.memory import ActivationModel
    from plait.plan.model import Model


@dataclass(frozen=True)
class StageCosts:
    """Seconds per micro-batch of a chunk (or of a rank: the sum of its chunks). ``w_compute`` is the
    weight-gradient part of ``b_compute`` (the W of zero-bubble schedules)."""

    f_compute: float = 0.0
    b_compute: float = 0.0
    w_compute: float = 0.0
    f_tp: float = 0.0
    b_tp: float = 0.0
    recompute: float = 0.0
    p2p: float = 0.0
    layers: int = 0

    @property
    def forward(self) -> float:
        return self.f_compute + self.f_tp

    @property
    def backward(self) -> float:
        return self.b_compute + self.b_tp + self.recompute

    @property
    def weight(self) -> float:
        return self.w_compute

    def __add__(self, other: StageCosts) -> StageCosts:
        a, b = self, other
        return StageCosts(a.f_compute + b.f_compute, a.b_compute + b.b_compute, a.w_compute + b.w_compute,
                          a.f_tp + b.f_tp, a.b_tp + b.b_tp, a.recompute + b.recompute, max(a.p2p, b.p2p),
                          a.layers + b.layers)

    def times(self, k: float) -> StageCosts:
        """``k`` of these (``k`` layers), the same point-to-point transfer."""
        return StageCosts(self.f_compute * k, self.b_compute * k, self.w_compute * k, self.f_tp * k,
                          self.b_tp * k, self.recompute * k, self.p2p, int(self.layers * k))


@dataclass(frozen=True)
class Blocks:
    """Per-micro-batch costs of one decoder layer, the embedding and the head + loss."""

    layer: StageCosts
    embedding: StageCosts
    head: StageCosts


@dataclass(frozen=True)
class Span:
    """The forward/backward part of a step as the hardware runs it: ``makespan`` (s), the average rank's busy
    wall time (``busy``; 0 where it is the schedule's compute alone) and how many times slower work every
    process does at once runs (``stretch``; 1 where processes do not share cores)."""

    makespan: float
    busy: float = 0.0
    stretch: float = 1.0


class CostModel(Protocol):
    """What a cluster's hardware and runtime cost: time of blocks, transfers, collectives and the end of a step,
    and the activation bytes a layer keeps. Every figure is for one device (process) of the cluster."""

    @property
    def weight_gather_bytes(self) -> int:
        """Bytes per weight ZeRO-1/2's all-gather of the updated weights moves."""
        ...

    def blocks(self, model: Model, layout: Layout, precision: str, tp_overlap: bool = False,
               overlap_sms: tuple[int, int] = TE_OVERLAP_SMS, elementwise: str = ELEMENTWISE[0],
               sp_async: bool = False, early_stop: bool = True, documents: DocumentLengths | None = None) -> Blocks:
        """One layer, the embedding and the head + loss, per micro-batch; ``tp_overlap``: the TP collectives
        pipelined with their GEMMs (``Training.tp_comm_overlap``), the pipelined scatters' kernels on
        ``overlap_sms`` SMs (``Training.tp_overlap_sms``); ``elementwise``: how the stack runs its element-wise
        kernels (``Training.elementwise``); ``sp_async``: SP's backward as Megatron-style layers run it
        (``Training.sp_async_backward``); ``early_stop``: full recomputation as torch's non-reentrant checkpoint
        runs it (``Training.recompute_early_stop``); ``documents``: the attention of a run with document masking, as
        its documents cut the rows (``Training.documents``; None: unmasked, ``plan.documents.masked_attention``)."""
        ...

    def p2p(self, model: Model, layout: Layout, precision: str) -> float:
        """One activation (or its gradient) sent between pipeline stages; 0 without a pipeline."""
        ...

    def collective(self, op: str, nbytes: float, n: int, span: int | None = None) -> float:
        """Seconds of ``op`` (all_reduce, all_gather, reduce_scatter, all_to_all, p2p) over ``n`` ranks on a
        tensor of ``nbytes`` in full; ``span``: how many consecutive ranks the group stretches over."""
        ...

    def activations(self, model: Model, layout: Layout, precision: str,
                    elementwise: str = ELEMENTWISE[0]) -> ActivationModel:
        """Activation bytes per micro-batch of a layer, the embedding and the head, and the working set, as the
        stack whose layers ``elementwise`` names (``Training.elementwise``) saves them."""
        ...

    def hidden_reduction(self, backward: float) -> float:
        """Seconds of the DP gradient reduction that ``backward`` (the busiest rank's) hides."""
        ...

    def optimizer_time(self, params: float, tensors: int, shards: float, optimizer: str = RUNTIME_OPTIMIZER) -> float:
        """The optimizer step over ``params`` parameters in ``tensors`` tensors, shared by ``shards`` ranks (under
        ZeRO: held over owned elements, ``plan.step_end.owned``), as ``optimizer`` (``Training.optimizer``) runs
        it."""
        ...

    def stream_time(self, nbytes: float, kernels: float) -> float:
        """Seconds to stream ``nbytes`` through memory in ``kernels`` copy kernels (ZeRO's publish)."""
        ...

    def accumulation_time(self, nbytes: float, grad_accumulation: str = RUNTIME_ACCUMULATION) -> float:
        """Seconds of one backward's weight-gradient accumulation moving ``nbytes`` through memory as
        ``grad_accumulation`` (``Training.grad_accumulation``) runs it (``plan.accumulation``)."""
        ...

    def step_syncs(self, model: Model, layout: Layout) -> tuple[float, float]:
        """(loss, gradient norm): the small per-step collectives the step time includes."""
        ...

    def forward_backward(self, model: Model, layout: Layout, precision: str, chunks: list[StageCosts], m: int,
                         rounds: str | None, makespan: float) -> Span:
        """The forward/backward part as run, given the chunks and the schedule's simulated ``makespan``."""
        ...
