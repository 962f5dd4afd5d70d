"""Time model: FLOPs, matmul efficiency, collectives and the per-micro-batch costs of every pipeline chunk
(the end of a step, DP reduction and optimizer: ``plan.step_end``).

Catalogue GPUs are costed from datasheet peaks with efficiencies fitted on published runs; a calibrated
host (``Cluster(profile=...)``) from its measured kernel speeds and collective times (``plan.eager``; the
compute of its eager work: ``plan.host_compute``).
"""

from __future__ import annotations

from plait.plan import eager
from plait.plan.catalogue import GPU, LINK_EFFICIENCY, Link
from plait.plan.config import Cluster, Layout
from plait.plan.costs import StageCosts
from plait.plan.host_compute import in_step_costs, selective_recompute
from plait.plan.memory import ACTIVATION_BYTES, activation_bytes_per_layer, layout_stages
from plait.plan.model import Model

# Matmul efficiency falls for narrow GEMMs: eff = gpu.matmul_efficiency · n/(n + GEMM_HALF), n the
# per-GPU shard width h/t (capped by the tokens of a micro-batch). One constant for every GPU,
# fitted with the per-GPU ceilings on the calibration set (docs/planner.md).
GEMM_HALF = 40.0
# Element-wise kernels (norms, softmax, dropout, residual adds, activations) move about this many
# times the layer's stored activation bytes through HBM per forward pass.
ELEMENTWISE_TRAFFIC = 0.75


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


def collective(cluster: Cluster, op: str, nbytes: float, n: int, span: int | None = None) -> float:
    """Seconds of ``op`` (all_reduce, all_gather, reduce_scatter, all_to_all, p2p) over ``n`` ranks on a
    tensor of ``nbytes`` in full; ``span``: how many consecutive ranks the group stretches over (picks
    NVLink or the network). Measured on a calibrated host, ring formulas on catalogue GPUs."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if cluster.profile is not None:
        return cluster.section.collective(op, n, nbytes)
    link = cluster.link(span or n)
    if op == "all_reduce":
        return ring_allreduce(nbytes, n, link)
    if op in ("all_gather", "reduce_scatter"):
        return ring_allgather(nbytes, n, link)
    if op == "all_to_all":
        return nbytes * (n - 1) / n / (link.bandwidth * LINK_EFFICIENCY) + (n - 1) * link.latency
    return nbytes / (link.bandwidth * LINK_EFFICIENCY) + link.latency  # p2p


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


def _gpu_layer(model: Model, cluster: Cluster, layout: Layout) -> StageCosts:
    """One layer on a catalogue GPU: FLOPs at the fitted efficiency plus element-wise HBM traffic."""
    gpu, t = cluster.gpu, layout.tp
    tokens = layout.microbatch_size * model.seq_len / layout.cp
    speed = gpu.peak_flops * matmul_efficiency(gpu, model, layout)
    traffic = ELEMENTWISE_TRAFFIC * activation_bytes_per_layer(model, _with(layout, recompute="none"))
    f = layer_forward_flops(model, tokens, model.seq_len) / t / speed + traffic / gpu.memory_bandwidth
    tp = _tp_comm_per_layer(model, cluster, layout, tokens)
    if layout.recompute == "full":
        recompute = f + tp
    elif layout.recompute == "selective":  # QK^T, softmax and AV again (Korthikanti et al. 2022, §5)
        recompute = 4 * tokens * model.seq_len * model.hidden / t / speed
    else:
        recompute = 0.0
    return StageCosts(f, 2 * f, f, tp, tp, recompute, 0.0, 1)


def _gpu_head(model: Model, cluster: Cluster, layout: Layout) -> StageCosts:
    tokens = layout.microbatch_size * model.seq_len / layout.cp
    speed = cluster.gpu.peak_flops * matmul_efficiency(cluster.gpu, model, layout)
    f = head_forward_flops(model, tokens) / layout.tp / speed
    return StageCosts(f, 2 * f, f, recompute=f if layout.recompute == "full" else 0.0)


def _layer_collectives(cluster: Cluster, sh: eager.Local, n_bytes: float) -> tuple[float, float, int, int]:
    """(forward seconds, backward seconds, forward count, backward count) of one layer's TP collectives, timed
    back to back: 2 regions, an all-reduce out (g) and, in backward, in (f); SP: gather in, scatter out."""
    t = sh.tp
    if sh.sp:
        f = 2 * (collective(cluster, "all_gather", n_bytes, t) + collective(cluster, "reduce_scatter", n_bytes, t))
        return f, f, 4, 4
    f = 2 * collective(cluster, "all_reduce", n_bytes, t)
    return f, f, 2, 2


def tp_wait(cluster: Cluster, tp: int, sp: bool, n_bytes: float) -> float:
    """Seconds each TP collective of a run waits beyond its back-to-back time, for an activation of
    ``n_bytes`` (``[b, s, h]`` in full), on a calibrated host that timed a tensor-parallel layer over ``tp``
    ranks (``plait.calibrate.tp_block``; else 0). At each size timed, the layer less its compute twin (timed
    in alternating rounds) is what its collectives took inside a run; less the same collectives as the
    profile's curves time them back to back, per collective, it is that size's wait. Between and beyond the
    smallest and largest size timed it is the line through those two (one size timed: its wait). Where
    processes outnumber cores it is mostly the time a rank waits for a peer the scheduler has not run yet,
    or for a core once its peers' data arrived; it grows with the bytes (in a run the collective's buffers
    come cold from compute, not hot from the last call of a tight loop). It is negative where a curve came
    out above what the layer showed (the curves are short tight loops, the noisier figure): the layer's
    collectives then cost what the layer showed (``_eager_block`` floors a block's collectives at 0)."""
    if cluster.profile is None or tp <= 1:
        return 0.0
    sec = cluster.section
    # the other form stands in where one was not timed (an older quick calibration timed no SP)
    blocks = [b for b in sec.tp_blocks if b.group == tp and b.sequence_parallel == sp] or \
        [b for b in sec.tp_blocks if b.group == tp]
    points = []
    for blk in blocks:
        sh = eager.block_local(blk.shape, tp, blk.sequence_parallel)
        f_tp, b_tp, nf, nb = _layer_collectives(cluster, sh, sh.n * 4)  # fp32, as timed
        points.append((sh.n * 4, (blk.seconds - blk.twin_s - f_tp - b_tp) / (nf + nb)))
    if not points:
        return 0.0
    (x0, y0), (x1, y1) = min(points), max(points)
    if x1 == x0:
        return y0
    return y0 + (y1 - y0) * (n_bytes - x0) / (x1 - x0)


def _eager_block(kind: str, model: Model, cluster: Cluster, layout: Layout, precision: str,
                 shared: bool) -> StageCosts:
    """A layer, the head or the embedding of plait's eager Llama: kernels and TP collectives (each with its
    wait for the slowest rank, ``tp_wait``)."""
    sh = eager.local(model, layout)
    d = ACTIVATION_BYTES[precision]
    t, n_bytes = layout.tp, sh.n * d
    work = {"layer": eager.layer_work, "head": eager.head_work, "embedding": eager.embedding_work}[kind](sh, d)
    c = in_step_costs(work, cluster.section, shared, layer=kind == "layer", tp=t)
    wait = tp_wait(cluster, t, sh.sp, n_bytes)
    if kind == "layer":
        f_tp, b_tp, nf, nb = _layer_collectives(cluster, sh, n_bytes)
    elif kind == "head":  # the loss's max and sums ([T] and [2, T]); in backward the input's gradient
        f_tp = collective(cluster, "all_reduce", 4 * sh.tokens, t) + collective(cluster, "all_reduce",
                                                                               8 * sh.tokens, t)
        f_tp += collective(cluster, "all_gather", n_bytes, t) if sh.sp else 0.0
        b_tp = collective(cluster, "reduce_scatter" if sh.sp else "all_reduce", n_bytes, t)
        nf, nb = 3 if sh.sp else 2, 1
    else:  # the embedding's partial rows summed (reduce-scattered under SP)
        f_tp, b_tp = collective(cluster, "reduce_scatter" if sh.sp else "all_reduce", n_bytes, t), 0.0
        nf, nb = 1, 0
    if t > 1:
        f_tp, b_tp = max(0.0, f_tp + nf * wait), max(0.0, b_tp + nb * wait)
    recompute = c.f_compute + f_tp if layout.recompute == "full" else 0.0
    if kind == "layer" and layout.recompute == "selective":  # the attention core again, under its checkpoint
        measured = selective_recompute(cluster.section, shared, sh)
        attn = cluster.section.rates["attention"]  # an older profile: the core's forward by the kernel figures
        recompute = measured if measured is not None else \
            work.attention / attn.at(work.attention_size, shared) * attn.forward_share
    return StageCosts(c.f_compute, c.b_compute, c.w_compute, f_tp, b_tp, recompute, 0.0,
                      1 if kind == "layer" else 0)


def block_costs(model: Model, cluster: Cluster, layout: Layout, precision: str = "bf16",
                shared: bool = False) -> tuple[StageCosts, StageCosts, StageCosts]:
    """(one layer, the embedding, the head + loss), per micro-batch. ``shared``: on a calibrated host,
    at the speeds one process gets while every process computes (else while the others wait)."""
    if cluster.profile is None:
        return _gpu_layer(model, cluster, layout), StageCosts(), _gpu_head(model, cluster, layout)
    return tuple(_eager_block(k, model, cluster, layout, precision, shared)  # type: ignore[return-value]
                 for k in ("layer", "embedding", "head"))


def p2p_time(model: Model, cluster: Cluster, layout: Layout, precision: str = "bf16") -> float:
    """One activation (or gradient) sent between pipeline stages: ``[b, s, h]`` scattered over the TP ranks
    (Narayanan et al. 2021, §4.1); on a calibrated host as measured, the whole tensor (plait sends it)."""
    if layout.pp == 1:
        return 0.0
    tokens = layout.microbatch_size * model.seq_len / layout.cp
    if cluster.profile is not None:
        return collective(cluster, "p2p", tokens * model.hidden * ACTIVATION_BYTES[precision], 2)
    link = cluster.link(layout.world)
    send = tokens * model.hidden * 2 / layout.tp
    return send / (link.bandwidth * LINK_EFFICIENCY) + link.latency


def chunk_costs(model: Model, cluster: Cluster, layout: Layout, precision: str = "bf16",
                shared: bool = False) -> list[StageCosts]:
    """Per-micro-batch costs of every pipeline chunk (its layers, the embedding on chunk 0, the head on
    the last), in the runtime's cut."""
    layer, embed, head = block_costs(model, cluster, layout, precision, shared)
    st = layout_stages(model, layout)
    p2p = p2p_time(model, cluster, layout, precision)
    last = len(st.chunk_layers) - 1
    made: dict[tuple[int, bool, bool], StageCosts] = {}  # chunks come in a few sizes: cost each once
    out = []
    for c, n in enumerate(st.chunk_layers):
        key = (n, c == 0, c == last)
        if key not in made:
            cost = layer.times(n)
            if c == 0:
                cost = cost + embed
            if c == last:
                cost = cost + head
            made[key] = StageCosts(cost.f_compute, cost.b_compute, cost.w_compute, cost.f_tp, cost.b_tp,
                                   cost.recompute, p2p, n)
        out.append(made[key])
    return out


def rank_costs(model: Model, cluster: Cluster, layout: Layout, precision: str = "bf16",
               shared: bool = False) -> list[StageCosts]:
    """Per-micro-batch costs of every pipeline rank: the sum of its chunks."""
    chunks = chunk_costs(model, cluster, layout, precision, shared)
    placement = layout_stages(model, layout).placement
    out = [StageCosts() for _ in range(layout.pp)]
    for c, cost in enumerate(chunks):
        out[placement[c]] = out[placement[c]] + cost
    return out


def stage_costs(model: Model, cluster: Cluster, layout: Layout, precision: str = "bf16") -> StageCosts:
    """Costs of the busiest pipeline rank (most forward + backward time per micro-batch)."""
    return max(rank_costs(model, cluster, layout, precision), key=lambda c: c.forward + c.backward)


def _with(layout: Layout, **changes: object) -> Layout:
    fields_ = {k: getattr(layout, k) for k in layout.__dataclass_fields__}
    return Layout(**{**fields_, **changes})
