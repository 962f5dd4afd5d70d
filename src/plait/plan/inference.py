"""Inference planning: TP vs PP vs mixes for serving — memory, KV cache, latency and throughput."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from plait.errors import ConfigError
from plait.plan.catalogue import LINK_EFFICIENCY
from plait.plan.config import Cluster, Layout
from plait.plan.memory import _rank_params, stage_layers
from plait.plan.model import Model
from plait.plan.timing import ring_allreduce

# Decode GEMMs are skinny (batch × h): their compute is cheap; efficiency of what compute there is.
DECODE_MATMUL_EFFICIENCY = 0.5
# Share of peak HBM bandwidth reached streaming weights and KV cache (memory-bound decode).
HBM_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Workload:
    """``batch`` concurrent sequences, each a ``prompt_len`` prompt and ``gen_len`` new tokens."""

    batch: int = 1
    prompt_len: int = 1024
    gen_len: int = 256

    def __post_init__(self) -> None:
        for k in ("batch", "prompt_len", "gen_len"):
            if int(getattr(self, k)) < 1:
                raise ConfigError(f"{k}: must be >= 1, got {getattr(self, k)}")

    @property
    def context(self) -> int:
        return self.prompt_len + self.gen_len


@dataclass(frozen=True)
class InferenceEstimate:
    """One serving layout: ``replicas`` copies of a tp × pp model, the batch split among them."""

    tp: int
    pp: int
    replicas: int
    weights_gb: float
    kv_cache_gb: float
    total_gb: float
    fits: bool
    max_batch: int  # per replica, at the workload's context length
    max_context: int  # tokens per sequence at the workload's batch
    token_latency_ms: float  # one decode step for the replica's batch
    ttft_ms: float  # prefill of the replica's batch
    throughput_tok_s: float  # all replicas
    breakdown_ms: dict[str, float]
    warnings: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"tp{self.tp} pp{self.pp}" + (f" ×{self.replicas}" if self.replicas > 1 else "")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class InferenceResult:
    """All layouts, best first (lowest per-token latency among those that fit), and a verdict."""

    options: list[InferenceEstimate]
    model: Model
    cluster: Cluster
    workload: Workload

    @property
    def best(self) -> InferenceEstimate | None:
        fit = [o for o in self.options if o.fits]
        return fit[0] if fit else None


def kv_bytes_per_token(model: Model, layers: int, tp: int) -> float:
    """K and V, bf16, for the KV heads one GPU holds (heads replicated when tp > n_kv_heads)."""
    heads = max(model.kv_heads // tp, 1)
    return layers * 2 * heads * model.head_dim * 2


def _stage(model: Model, cluster: Cluster, tp: int, layers: int, last: bool, batch: int,
           ctx: int) -> dict[str, float]:
    """One decode step on one pipeline stage: weights and KV streamed from HBM (memory bound) or
    the matmuls (compute bound), whichever is slower, then 2 all-reduces of [batch, h] per layer."""
    gpu = cluster.gpu
    lay = Layout(tp=tp)
    dense, expert = _rank_params(model, lay, layers, False, last)
    active = dense + (expert * model.top_k / model.n_experts if model.is_moe else 0)
    stream = 2 * active + batch * ctx * kv_bytes_per_token(model, layers, tp)
    mem_s = stream / (gpu.memory_bandwidth * HBM_EFFICIENCY)
    flops = 2 * batch * active + layers * 4 * batch * ctx * model.hidden / tp
    comp_s = flops / (gpu.peak_flops * DECODE_MATMUL_EFFICIENCY)
    comm_s = layers * 2 * ring_allreduce(batch * model.hidden * 2, tp, cluster.link(tp))
    return {"memory": mem_s, "compute": comp_s, "tp_comm": comm_s, "step": max(mem_s, comp_s) + comm_s}


def _option(model: Model, cluster: Cluster, w: Workload, tp: int, pp: int) -> InferenceEstimate:
    replicas = cluster.n_gpus // (tp * pp)
    batch = -(-w.batch // replicas)
    layers = stage_layers(model, pp)
    usable = cluster.usable_memory
    worst_w = max(2 * sum(_rank_params(model, Layout(tp=tp, pp=pp), n, r == 0, r == pp - 1))
                  for r, n in enumerate(layers))
    kv_tok = kv_bytes_per_token(model, max(layers), tp)
    kv = kv_tok * batch * w.context
    workspace = 4 * batch * w.prompt_len * model.hidden * 2  # prefill activations of one layer
    total = worst_w + kv + workspace
    free = max(usable - worst_w - workspace, 0.0)
    stages = [_stage(model, cluster, tp, n, r == pp - 1, batch, w.context) for r, n in enumerate(layers)]
    link = cluster.link(tp * pp)
    p2p = (pp - 1) * (batch * model.hidden * 2 / (link.bandwidth * LINK_EFFICIENCY) + link.latency)
    latency = sum(s["step"] for s in stages) + p2p
    prefill_flops = 2 * model.n_params(active=True) * batch * w.prompt_len
    # one batch crosses the stages one after another: prefill uses tp GPUs at a time, not tp·pp
    prefill = prefill_flops / (tp * cluster.gpu.peak_flops * 0.6) + sum(
        n * 2 * ring_allreduce(batch * w.prompt_len * model.hidden * 2, tp, cluster.link(tp)) for n in layers)
    warnings = []
    if tp > cluster.gpus_per_node:
        warnings.append(f"TP={tp} crosses nodes ({cluster.inter.name}): each layer waits on the network")
    elif tp > 1 and "PCIe" in cluster.gpu.intra.name:
        warnings.append(f"TP={tp} runs over {cluster.gpu.intra.name}: all-reduces per layer are slow")
    breakdown = {k: 1e3 * sum(s[k] for s in stages) for k in ("memory", "compute", "tp_comm")}
    breakdown["p2p"] = 1e3 * p2p
    return InferenceEstimate(
        tp=tp, pp=pp, replicas=replicas, weights_gb=worst_w / 1e9, kv_cache_gb=kv / 1e9,
        total_gb=total / 1e9, fits=total <= usable, max_batch=int(free // (kv_tok * w.context)),
        max_context=int(free // (kv_tok * batch)), token_latency_ms=1e3 * latency, ttft_ms=1e3 * prefill,
        throughput_tok_s=replicas * batch / latency, breakdown_ms=breakdown, warnings=warnings,
    )


def plan_inference(model: Model, cluster: Cluster, workload: Workload) -> InferenceResult:
    """Compare every tp × pp (× replicas) serving layout on ``cluster`` for ``workload``."""
    opts = []
    n = cluster.n_gpus
    for tp in (d for d in (1, 2, 4, 8, 16, 32, 64) if n % d == 0 and model.n_heads % d == 0):
        for pp in (d for d in range(1, n // tp + 1) if (n // tp) % d == 0 and d <= model.n_layers):
            opts.append(_option(model, cluster, workload, tp, pp))
    opts.sort(key=lambda o: (not o.fits, o.token_latency_ms, -o.throughput_tok_s))
    return InferenceResult(opts, model, cluster, workload)
