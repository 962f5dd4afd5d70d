"""The cost model of catalogue GPUs: datasheet peaks at efficiencies fitted on published runs, ring formulas for
collectives, Korthikanti et al.'s activation count (Megatron-LM's kernels, 16-bit).

What one layer costs: its FLOPs (``timing.layer_forward_flops``) at ``peak · matmul_efficiency`` (falling for
narrow GEMMs), plus its element-wise kernels' HBM traffic; backward twice the forward (half of it weight
gradients); the TP all-reduces (or SP's gathers and scatters) and MoE's all-to-alls on ring formulas over the
link the group spans (NVLink inside a node, the interconnect across). The fit and its errors on published runs:
``plan.published_fit``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from plait.plan.catalogue import GPU, LINK_EFFICIENCY, Link
from plait.plan.costs import Blocks, Span, StageCosts
from plait.plan.memory import ActivationModel, activation_bytes_per_layer, zero3_working
from plait.plan.timing import head_forward_flops, layer_forward_flops

if TYPE_CHECKING:
    from plait.plan.cluster import Cluster
    from plait.plan.config import Layout
    from plait.plan.model import Model

# Matmul efficiency falls for narrow GEMMs: eff = gpu.matmul_efficiency · n/(n + GEMM_HALF), n the
# per-GPU shard width h/t (capped by the tokens of a micro-batch). One constant for every GPU,
# fitted with the per-GPU ceilings on the calibration set (docs/planner.md).
GEMM_HALF = 40.0
# Element-wise kernels (norms, softmax, dropout, residual adds, activations) move about this many
# times the layer's stored activation bytes through HBM per forward pass.
ELEMENTWISE_TRAFFIC = 0.75
# Adam step: read fp32 master, m, v and grad (16 B), write master, m, v (12 B) and bf16 weight (2 B).
OPTIMIZER_TRAFFIC = 30.0


def ring_allreduce(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: each rank moves 2(n-1)/n of the tensor, in 2(n-1) latency-bound steps
    (Patarasuk & Yuan 2009; Thakur et al. 2005)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (link.bandwidth * LINK_EFFICIENCY) + 2 * (n - 1) * link.latency


def ring_allgather(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of a tensor of ``nbytes`` in total: (n-1)/n of it."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / (link.bandwidth * LINK_EFFICIENCY) + (n - 1) * link.latency


def matmul_efficiency(gpu: GPU, model: Model, layout: Layout) -> float:
    """Achieved share of peak FLOP/s for this layer's GEMMs."""
    n = min(model.hidden / layout.tp, layout.microbatch_size * model.seq_len / layout.cp)
    return gpu.matmul_efficiency * n / (n + GEMM_HALF)


@dataclass(frozen=True)
class GpuCosts:
    """The ``CostModel`` of a cluster of catalogue GPUs (``Cluster(gpu, n_gpus, ...)``)."""

    cluster: Cluster = field(repr=False, compare=False)
    #: Megatron-LM's distributed optimizer gathers the bf16 weights
    weight_gather_bytes: int = 2

    @property
    def gpu(self) -> GPU:
        return self.cluster.gpu

    def collective(self, op: str, nbytes: float, n: int, span: int | None = None) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        link = self.cluster.link(span or n)
        if op == "all_reduce":
            return ring_allreduce(nbytes, n, link)
        if op in ("all_gather", "reduce_scatter"):
            return ring_allgather(nbytes, n, link)
        if op == "all_to_all":
            return nbytes * (n - 1) / n / (link.bandwidth * LINK_EFFICIENCY) + (n - 1) * link.latency
        return nbytes / (link.bandwidth * LINK_EFFICIENCY) + link.latency  # p2p

    def _tp_comm_per_layer(self, model: Model, layout: Layout, tokens: float) -> float:
        """Forward collectives of one layer: 2 all-reduces of [b, s, h] (TP, Shoeybi et al. 2019) or
        2 all-gathers + 2 reduce-scatters with SP (same volume); MoE all-to-all dispatch and combine;
        context-parallel K/V ring exchange (its exposure beyond the attention it overlaps is ignored)."""
        act = tokens * model.hidden * 2  # bf16 [b, s/cp, h]
        t, link = layout.tp, self.cluster.link
        out = 2 * ring_allreduce(act, t, link(t))
        if model.is_moe and layout.ep > 1:
            e = layout.ep
            a2a = act * model.top_k * (e - 1) / e / (link(t * e).bandwidth * LINK_EFFICIENCY)
            out += 2 * (a2a + (e - 1) * link(t * e).latency)
        return out

    def blocks(self, model: Model, layout: Layout, precision: str) -> Blocks:
        """A layer: FLOPs at the fitted efficiency plus element-wise HBM traffic, its TP collectives and what
        recomputation redoes; the head: its FLOPs. The embedding's lookup is free."""
        gpu, t = self.gpu, layout.tp
        tokens = layout.microbatch_size * model.seq_len / layout.cp
        speed = gpu.peak_flops * matmul_efficiency(gpu, model, layout)
        traffic = ELEMENTWISE_TRAFFIC * activation_bytes_per_layer(model, replace(layout, recompute="none"))
        f = layer_forward_flops(model, tokens, model.seq_len) / t / speed + traffic / gpu.memory_bandwidth
        tp = self._tp_comm_per_layer(model, layout, tokens)
        if layout.recompute == "full":
            recompute = f + tp
        elif layout.recompute == "selective":  # QK^T, softmax and AV again (Korthikanti et al. 2022, §5)
            recompute = 4 * tokens * model.seq_len * model.hidden / t / speed
        else:
            recompute = 0.0
        head = head_forward_flops(model, tokens) / layout.tp / speed
        return Blocks(StageCosts(f, 2 * f, f, tp, tp, recompute, 0.0, 1), StageCosts(),
                      StageCosts(head, 2 * head, head, recompute=head if layout.recompute == "full" else 0.0))

    def p2p(self, model: Model, layout: Layout, precision: str) -> float:
        """``[b, s, h]`` in bf16 scattered over the TP ranks (Narayanan et al. 2021, §4.1)."""
        if layout.pp == 1:
            return 0.0
        link = self.cluster.link(layout.world)
        send = layout.microbatch_size * model.seq_len / layout.cp * model.hidden * 2 / layout.tp
        return send / (link.bandwidth * LINK_EFFICIENCY) + link.latency

    def activations(self, model: Model, layout: Layout, precision: str) -> ActivationModel:
        """Korthikanti et al. 2022's count (§4; 16-bit whatever ``precision``): a layer's bytes, the first
        stage's embedding dropout mask sbh, the last's output layer and loss 4sbh/t·(1 + V/h); full
        recomputation holds the recomputed layer's (selective) set once."""
        working = zero3_working(model, layout)
        if layout.recompute == "full":
            working += activation_bytes_per_layer(model, replace(layout, recompute="selective"))
        last = 4 * model.seq_len / layout.cp * layout.microbatch_size * model.hidden / layout.tp * (
            1 + model.vocab / model.hidden)
        first = model.seq_len / layout.cp * layout.microbatch_size * model.hidden / (
            layout.tp if layout.sequence_parallel else 1)
        return ActivationModel(activation_bytes_per_layer(model, layout), first, last, working)

    def hidden_reduction(self, backward: float) -> float:
        """All of it: the reduction runs on the network engines while the SMs compute."""
        return backward

    def optimizer_time(self, params: float, tensors: int, shards: int) -> float:
        """Adam streams its state through HBM."""
        return OPTIMIZER_TRAFFIC * params / shards / self.gpu.memory_bandwidth

    def stream_time(self, nbytes: float, kernels: float) -> float:
        return nbytes / self.gpu.memory_bandwidth

    def step_syncs(self, model: Model, layout: Layout) -> tuple[float, float]:
        """Negligible on GPUs: not counted."""
        return 0.0, 0.0

    def forward_backward(self, model: Model, layout: Layout, precision: str, chunks: list[StageCosts], m: int,
                         rounds: str | None, makespan: float) -> Span:
        """The simulated schedule as it is: every GPU computes on its own."""
        return Span(makespan)

