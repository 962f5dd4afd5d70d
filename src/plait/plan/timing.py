"""Time model: FLOPs, matmul efficiency, ring collectives and the per-micro-batch stage costs."""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.catalogue import GPU, LINK_EFFICIENCY, Link
from plait.plan.config import Cluster, Layout
from plait.plan.memory import activation_bytes_per_layer, head_layers, stage_layers
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


def layer_forward_flops(model: Model, tokens: float, seq_len: float) -> float:
    """Forward FLOPs of one layer over ``tokens`` tokens: 2 per weight of every matmul a token
    uses (active experts only) plus attention's QK^T and AV, 4·s·h per token (Narayanan et al.
    2021, eq. 2; counted without causal savings as there)."""
    matmul = model.layer_params(active=True) - 2 * model.norm_params()
    return 2 * tokens * matmul + 4 * tokens * seq_len * model.hidden


def head_forward_flops(model: Model, tokens: float) -> float:
    return 2 * tokens * model.hidden * model.vocab


def model_flops_per_step(model: Model, global_batch: int) -> float:
    """Model FLOPs of one step, forward + backward (3×forward), no recomputation: the MFU numerator
    (Chowdhery et al. 2022, App. B)."""
    tokens = global_batch * model.seq_len
    fwd = model.n_layers * layer_forward_flops(model, tokens, model.seq_len)
    return 3 * (fwd + head_forward_flops(model, tokens))


@dataclass(frozen=True)
class StageCosts:
    """Seconds per micro-batch on the busiest pipeline rank."""

    f_compute: float
    f_tp: float
    recompute: float
    p2p: float
    layers: int

    @property
    def forward(self) -> float:
        return self.f_compute + self.f_tp

    @property
    def backward(self) -> float:  # 2× forward compute, the same collectives, plus recomputation
        return 2 * self.f_compute + self.f_tp + self.recompute

    @property
    def weight(self) -> float:  # the W half of a split backward (zero-bubble schedules): no comm
        return self.f_compute


def _tp_comm_per_layer(model: Model, cluster: Cluster, layout: Layout, tokens: float) -> float:
    """Forward collectives of one layer: 2 all-reduces of [b, s, h] (TP, Shoeybi et al. 2019) or
    2 all-gathers + 2 reduce-scatters with SP (same volume); MoE all-to-all dispatch and combine;
    context-parallel K/V ring exchange (its exposure beyond the attention it overlaps is ignored)."""
    act = tokens * model.hidden * 2  # bf16 [b, s/cp, h]
    t = layout.tp
    out = 2 * ring_allreduce(act, t, cluster.link(t))
    if model.is_moe and layout.ep > 1:
        e = layout.ep
        a2a = act * model.top_k * (e - 1) / e / (cluster.link(t * e).bandwidth * LINK_EFFICIENCY)
        out += 2 * (a2a + (e - 1) * cluster.link(t * e).latency)
    return out


def stage_costs(model: Model, cluster: Cluster, layout: Layout) -> StageCosts:
    """Forward/backward/recompute/p2p seconds of one micro-batch on the busiest pipeline rank."""
    gpu, t = cluster.gpu, layout.tp
    tokens = layout.microbatch_size * model.seq_len / layout.cp
    layers = stage_layers(model, layout.pp)
    head = head_layers(model)
    busiest = max(range(layout.pp), key=lambda r: layers[r] + (head if r == layout.pp - 1 else 0))
    n_layers = layers[busiest]
    speed = gpu.peak_flops * matmul_efficiency(gpu, model, layout)
    flops = n_layers * layer_forward_flops(model, tokens, model.seq_len) / t
    if busiest == layout.pp - 1:
        flops += head_forward_flops(model, tokens) / t
    traffic = ELEMENTWISE_TRAFFIC * n_layers * activation_bytes_per_layer(
        model, _with(layout, recompute="none"))
    f_compute = flops / speed + traffic / gpu.memory_bandwidth
    f_tp = n_layers * _tp_comm_per_layer(model, cluster, layout, tokens)
    if layout.recompute == "full":
        recompute = f_compute + f_tp
    elif layout.recompute == "selective":  # QK^T, softmax and AV again (Korthikanti et al. 2022, §5)
        recompute = n_layers * 4 * tokens * model.seq_len * model.hidden / t / speed
    else:
        recompute = 0.0
    link = cluster.link(layout.world)
    send = tokens * model.hidden * 2 / t  # scatter/gather over the TP ranks (Narayanan et al. §4.1)
    p2p = send / (link.bandwidth * LINK_EFFICIENCY) + link.latency if layout.pp > 1 else 0.0
    return StageCosts(f_compute, f_tp, recompute, p2p, n_layers)


def dp_sync_time(model: Model, cluster: Cluster, layout: Layout, params_on_gpu: float) -> float:
    """Gradient synchronisation at the end of a step over dp·cp (Rajbhandari et al. 2020, §5): an
    all-reduce of fp32 gradients (no ZeRO); a reduce-scatter of them plus an all-gather of the
    updated bf16 weights (ZeRO-1); the all-gather only (ZeRO-2: gradients were reduce-scattered per
    micro-batch); nothing (ZeRO-3: weights are gathered when used)."""
    n = layout.dp * layout.cp
    link = cluster.link(layout.tp * n)
    if layout.zero == 0:
        return ring_allreduce(4 * params_on_gpu, n, link)
    gather = ring_allgather(2 * params_on_gpu, n, link)
    return {1: ring_allgather(4 * params_on_gpu, n, link) + gather, 2: gather}.get(layout.zero, 0.0)


def zero_per_microbatch(cluster: Cluster, layout: Layout, params_on_gpu: float) -> float:
    """Communication ZeRO-2/3 repeat every micro-batch: ZeRO-2 reduce-scatters the fp32 gradients
    (they are kept sharded); ZeRO-3 also gathers the bf16 weights in forward and again in backward.
    It overlaps compute (see ``estimate``)."""
    if layout.zero < 2:
        return 0.0
    n = layout.dp * layout.cp
    link = cluster.link(layout.tp * n)
    out = ring_allgather(4 * params_on_gpu, n, link)
    return out + (2 * ring_allgather(2 * params_on_gpu, n, link) if layout.zero == 3 else 0.0)


def optimizer_time(cluster: Cluster, layout: Layout, params_on_gpu: float) -> float:
    shard = layout.dp * layout.cp if layout.zero >= 1 else 1
    return OPTIMIZER_TRAFFIC * params_on_gpu / shard / cluster.gpu.memory_bandwidth


def _with(layout: Layout, **changes: object) -> Layout:
    fields = {k: getattr(layout, k) for k in layout.__dataclass_fields__}
    return Layout(**{**fields, **changes})
