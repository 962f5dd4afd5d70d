"""Inference planning: TP vs PP vs mixes for serving — memory, KV cache, latency and throughput."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from plait.errors import FieldError
from plait.plan.catalogue import LINK_EFFICIENCY
from plait.plan.cluster import Cluster
from plait.plan.config import Layout
from plait.plan.memory import rank_params, stage_layers
from plait.plan.model import Model

# Decode GEMMs are skinny (batch × h): their compute is cheap; efficiency of what compute there is.
DECODE_MATMUL_EFFICIENCY = 0.5
# Prefill GEMMs are wide: this share of peak.
PREFILL_MATMUL_EFFICIENCY = 0.6
# Share of peak HBM bandwidth reached streaming weights and KV cache (memory-bound decode).
HBM_EFFICIENCY = 0.8
# Bytes per weight (seed table: Llama 3 70B is 141 GB at bf16/fp16, 71 at int8 or fp8, 35 at int4).
# int8/int4 are weight-only: dequantised into bf16 matmuls; fp8 computes in fp8 where the GPU has it.
WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class Workload:
    """``batch`` concurrent sequences, each a ``prompt_len`` prompt and ``gen_len`` new tokens."""

    batch: int = 1
    prompt_len: int = 1024
    gen_len: int = 256

    def __post_init__(self) -> None:
        for k in ("batch", "prompt_len", "gen_len"):
            if int(getattr(self, k)) < 1:
                raise FieldError(k, getattr(self, k), "must be >= 1")

    @property
    def context(self) -> int:
        return self.prompt_len + self.gen_len


@dataclass(frozen=True)
class InferenceEstimate:
    """One serving layout: ``replicas`` copies of a tp × pp model, the batch split among them.

    Decode runs as ``plait serve`` does: the replica's running batch is cut into ``groups`` (up to pp) that
    flow through the stages as a wavefront, so one step takes ``groups + pp - 1`` stage ticks; every
    running request gets one token per step. Prefill: each prompt is its own group, through the same
    wavefront. ``request_ms`` = TTFT + (gen_len - 1) · token latency ranks the layouts.
    """

    tp: int
    pp: int
    replicas: int
    weights: str
    weights_gb: float
    kv_cache_gb: float
    total_gb: float
    fits: bool
    max_batch: int  # per replica, at the workload's context length
    max_context: int  # KV-cache room in tokens per sequence at the workload's batch (not the model's context)
    groups: int  # decode groups in flight through the stages
    token_latency_ms: float  # one decode step for the replica's batch
    ttft_ms: float  # mean time to first token of the replica's batch (prefill)
    request_ms: float  # TTFT + (gen_len - 1) · token latency: what a request waits in all
    throughput_tok_s: float  # all replicas
    tp_allreduce_bytes: float  # one decode all-reduce of [rows, h] (2 per layer)
    tp_allreduce_ms: float  # all of a decode step's all-reduces on the critical path
    tp_latency_ms: float  # of which the latency term: 2(t-1) hops × the link's latency, per all-reduce
    breakdown_ms: dict[str, float]
    warnings: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"tp{self.tp} pp{self.pp}" + (f" ×{self.replicas}" if self.replicas > 1 else "")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class InferenceResult:
    """All layouts, best first (least request latency among those that fit), and a verdict."""

    options: list[InferenceEstimate]
    model: Model
    cluster: Cluster
    workload: Workload

    @property
    def best(self) -> InferenceEstimate | None:
        fit = [o for o in self.options if o.fits]
        return fit[0] if fit else None


def rank(options: list[InferenceEstimate]) -> list[InferenceEstimate]:
    """Fitting layouts first, by what a request waits (TTFT and its tokens), then by throughput."""
    return sorted(options, key=lambda o: (not o.fits, o.request_ms, -o.throughput_tok_s))


def kv_bytes_per_token(model: Model, layers: int, tp: int) -> float:
    """K and V, bf16, for the KV heads one GPU holds (heads replicated when tp > n_kv_heads)."""
    heads = max(model.kv_heads // tp, 1)
    return layers * 2 * heads * model.head_dim * 2


def _flops(cluster: Cluster, weights: str) -> float:
    """Peak the matmuls run at: fp8 where the GPU computes in it, else bf16 (weight-only int8/int4)."""
    return cluster.gpu.peak_flops * (2.0 if weights == "fp8" and cluster.gpu.fp8 else 1.0)


def _allreduce(cluster: Cluster, nbytes: float, tp: int) -> tuple[float, float]:
    """(seconds, latency-term seconds) of a ring all-reduce of ``nbytes`` over ``tp`` GPUs."""
    if tp <= 1:
        return 0.0, 0.0
    link = cluster.link(tp)
    latency = 2 * (tp - 1) * link.latency
    return 2 * (tp - 1) / tp * nbytes / (link.bandwidth * LINK_EFFICIENCY) + latency, latency


def _stage(model: Model, cluster: Cluster, tp: int, layers: int, last: bool, rows: int, ctx: int,
           weights: str) -> dict[str, float]:
    """One decode step of ``rows`` rows on one pipeline stage: weights and KV streamed from HBM (memory
    bound) or the matmuls (compute bound), whichever is slower, then 2 all-reduces of [rows, h] per layer."""
    gpu = cluster.gpu
    # experts split over TP, as serving engines shard them (``Layout.expert_tp``)
    dense, expert = rank_params(model, Layout(tp=tp, expert_tp=True), layers, False, last)
    active = dense + (expert * model.top_k / model.n_experts if model.is_moe else 0)
    stream = WEIGHT_BYTES[weights] * active + rows * ctx * kv_bytes_per_token(model, layers, tp)
    mem_s = stream / (gpu.memory_bandwidth * HBM_EFFICIENCY)
    flops = 2 * rows * active + layers * 4 * rows * ctx * model.hidden / tp
    comp_s = flops / (_flops(cluster, weights) * DECODE_MATMUL_EFFICIENCY)
    ar, lat = _allreduce(cluster, rows * model.hidden * 2, tp)
    return {"memory": mem_s, "compute": comp_s, "tp_comm": layers * 2 * ar, "tp_latency": layers * 2 * lat,
            "step": max(mem_s, comp_s) + layers * 2 * ar}


def _prefill_tick(model: Model, cluster: Cluster, tp: int, layers: int, prompt: int, weights: str) -> float:
    """One prompt through one stage: its matmuls on tp GPUs plus 2 all-reduces of [prompt, h] per layer."""
    flops = 2 * model.layer_params(active=True) * layers * prompt + layers * 4 * prompt * prompt * model.hidden
    ar, _ = _allreduce(cluster, prompt * model.hidden * 2, tp)
    return flops / (tp * _flops(cluster, weights) * PREFILL_MATMUL_EFFICIENCY) + layers * 2 * ar


def _option(model: Model, cluster: Cluster, w: Workload, tp: int, pp: int, weights: str) -> InferenceEstimate:
    replicas = cluster.n_gpus // (tp * pp)
    batch = -(-w.batch // replicas)
    layers = stage_layers(model, pp)
    usable = cluster.usable_memory
    served = Layout(tp=tp, pp=pp, expert_tp=True)  # experts split over TP, as in ``_stage``
    worst_w = max(WEIGHT_BYTES[weights] * sum(rank_params(model, served, n, r == 0, r == pp - 1))
                  for r, n in enumerate(layers))
    kv_tok = kv_bytes_per_token(model, max(layers), tp)
    kv = kv_tok * batch * w.context
    workspace = 4 * w.prompt_len * model.hidden * 2  # prefill activations of one layer (one prompt per group)
    total = worst_w + kv + workspace
    free = max(usable - worst_w - workspace, 0.0)
    groups = min(pp, batch)
    rows = -(-batch // groups)
    stages = [_stage(model, cluster, tp, n, r == pp - 1, rows, w.context, weights) for r, n in enumerate(layers)]
    link = cluster.link(tp * pp)
    p2p = (rows * model.hidden * 2 / (link.bandwidth * LINK_EFFICIENCY) + link.latency) if pp > 1 else 0.0
    tick = max(s["step"] for s in stages) + p2p
    step = (groups + pp - 1) * tick - p2p  # the last group's tokens leave the last stage
    prefill = max(_prefill_tick(model, cluster, tp, n, w.prompt_len, weights) for n in layers) + p2p
    ttft = ((batch - 1) / 2 + pp) * prefill - p2p  # mean over the batch: prompts one group each
    ticks = groups + pp - 1
    breakdown = {k: 1e3 * ticks * max(s[k] for s in stages) for k in ("memory", "compute", "tp_comm")}
    breakdown["p2p"] = 1e3 * (ticks - 1) * p2p
    warnings = []
    slow = "crosses nodes" if tp > cluster.gpus_per_node else "runs over" if "NVLink" not in cluster.link(tp).name \
        else ""
    if tp > 1 and slow:
        lat = 1e3 * ticks * max(s["tp_latency"] for s in stages)
        warnings.append(f"TP={tp} {slow} {cluster.link(tp).name}: its all-reduces take "
                        f"{breakdown['tp_comm']:.1f} ms per token, {lat:.1f} ms of it link latency")
    ar_bytes = rows * model.hidden * 2
    return InferenceEstimate(
        tp=tp, pp=pp, replicas=replicas, weights=weights, weights_gb=worst_w / 1e9, kv_cache_gb=kv / 1e9,
        total_gb=total / 1e9, fits=total <= usable, max_batch=int(free // (kv_tok * w.context)),
        max_context=int(free // (kv_tok * batch)), groups=groups, token_latency_ms=1e3 * step,
        ttft_ms=1e3 * ttft, request_ms=1e3 * (ttft + (w.gen_len - 1) * step),
        throughput_tok_s=replicas * batch / step, tp_allreduce_bytes=ar_bytes if tp > 1 else 0.0,
        tp_allreduce_ms=breakdown["tp_comm"], tp_latency_ms=1e3 * ticks * max(s["tp_latency"] for s in stages),
        breakdown_ms=breakdown, warnings=warnings,
    )


def plan_inference(model: Model, cluster: Cluster, workload: Workload, weights: str = "bf16",
                   tps: list[int] | None = None) -> InferenceResult:
    """Compare every tp × pp (× replicas) serving layout on ``cluster`` for ``workload`` with ``weights``
    stored as bf16, fp16, fp8, int8 or int4 (``tps``: only these TP sizes)."""
    if weights not in WEIGHT_BYTES:
        raise FieldError("weights", weights, f"not one of {', '.join(WEIGHT_BYTES)}")
    opts = []
    n = cluster.n_gpus
    for tp in (d for d in (1, 2, 4, 8, 16, 32, 64) if n % d == 0 and model.n_heads % d == 0):
        if tps is not None and tp not in tps:
            continue
        for pp in (d for d in range(1, n // tp + 1) if (n // tp) % d == 0 and d <= model.n_layers):
            opts.append(_option(model, cluster, workload, tp, pp, weights))
    return InferenceResult(rank(opts), model, cluster, workload)
