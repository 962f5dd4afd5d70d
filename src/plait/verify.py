"""``plait verify``: run a small Llama under a layout and on one device, and compare every tensor."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from plait.errors import ConfigError

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # float32 rounding: parallel equals single device within these


@dataclass
class VerifyConfig:
    tp: int = 2
    pp: int = 2
    dp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 8
    virtual_stages: int | None = None  # None: the schedule's default (2 for interleaved, V-shaped; else 1)
    recompute: str = "none"  # "full": recompute each layer's activations in the backward
    sequence_parallel: bool = False
    tie_embeddings: bool = False
    n_layers: int = 8
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    seq_len: int = 16
    batch_size: int = 8
    seed: int = 0
    n_experts: int = 1  # > 1: mixture-of-experts feed-forward layers (plait.models.moe)
    top_k: int = 1
    ep: int = 1  # expert-parallel group size (experts spread over ep ranks of the dp x tp plane)
    expert_tp: bool = False  # each expert split over the TP group (then ep must divide dp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass
class TensorError:
    name: str
    shape: tuple[int, ...]
    max_abs: float
    rel: float

    @property
    def ok(self) -> bool:
        return self.rel <= GRAD_TOL


@dataclass
class VerifyResult:
    config: VerifyConfig
    loss_parallel: float
    loss_single: float
    grads: list[TensorError]
    logits_rel: float
    peak_measured: list[float]
    peak_simulated: list[float]
    trace_text: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def loss_rel(self) -> float:
        return abs(self.loss_parallel - self.loss_single) / max(abs(self.loss_single), 1e-30)

    @property
    def ok(self) -> bool:
        peaks_ok = all(abs(a - b) < 1e-9 for a, b in zip(self.peak_measured, self.peak_simulated, strict=True))
        return (self.loss_rel <= LOSS_TOL and all(g.ok for g in self.grads) and self.logits_rel <= LOSS_TOL
                and peaks_ok)

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "ok": self.ok, "loss_parallel": self.loss_parallel,
                "loss_single": self.loss_single, "loss_rel": self.loss_rel, "logits_rel": self.logits_rel,
                "peak_measured": self.peak_measured, "peak_simulated": self.peak_simulated,
                "grads": [{**asdict(g), "ok": g.ok} for g in self.grads]}


def _rel(a, b) -> tuple[float, float]:
    diff = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    return diff, diff / scale if scale > 0 else diff


def _model_config(cfg: VerifyConfig):
    from plait.models import LlamaConfig

    return LlamaConfig(vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                       n_kv_heads=cfg.n_kv_heads, max_seq_len=cfg.seq_len, tie_embeddings=cfg.tie_embeddings,
                       n_experts=cfg.n_experts, top_k=cfg.top_k)


def _rank_main(cfg: VerifyConfig) -> VerifyResult | None:
    """Runs on every rank of the launched world; rank 0 returns the comparison."""
    import torch
    import torch.distributed as dist

    import plait
    from plait.models import Llama
    from plait.sim import Costs, simulate

    ctx = plait.init(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, ep=cfg.ep, expert_tp=cfg.expert_tp)
    mcfg = _model_config(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    torch.manual_seed(cfg.seed)
    reference = Llama(mcfg)
    ref_loss = reference.loss(inputs, targets)
    ref_loss.backward()
    torch.manual_seed(cfg.seed)
    pm = plait.parallelize(Llama(mcfg), ctx, schedule=cfg.schedule, microbatches=cfg.microbatches,
                           virtual_stages=cfg.virtual_stages, sequence_parallel=cfg.sequence_parallel,
                           activation_checkpointing=cfg.recompute == "full")
    per = cfg.batch_size // cfg.dp
    local = slice(ctx.dp_rank * per, (ctx.dp_rank + 1) * per)
    pm.train_step(inputs[local], targets[local])  # warm-up: the first step pays one-time set-up costs
    loss = pm.train_step(inputs[local], targets[local], trace=True)
    grads = pm.full_state_dict(grads=True)
    report = pm.trace_report()
    logits = pm.eval_step(inputs[local])
    if ctx.rank != 0:
        dist.barrier()
        return None
    errors = []
    for name, p in reference.named_parameters():
        max_abs, rel = _rel(grads[name], p.grad)
        errors.append(TensorError(name, tuple(p.shape), max_abs, rel))
    _, logits_rel = _rel(logits, reference(inputs[local]).detach())
    sim = simulate(pm.schedule, Costs())
    dist.barrier()
    return VerifyResult(cfg, loss, float(ref_loss), errors, logits_rel, report.measured.peak_activations,
                        sim.peak_activations, report.to_text(68))


def check(cfg: VerifyConfig) -> None:
    """Raise ConfigError for a layout that cannot work, before launching anything."""
    from plait.schedules import build_schedule

    for name in ("tp", "pp", "dp", "microbatches", "batch_size", "n_layers"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be >= 1")
    if cfg.batch_size % cfg.dp or (cfg.batch_size // cfg.dp) % cfg.microbatches:
        raise ConfigError(f"batch_size={cfg.batch_size} must split into dp={cfg.dp} replicas of "
                          f"microbatches={cfg.microbatches} micro-batches each")
    from plait.pipeline.partition import RECOMPUTE_MODES

    if cfg.recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute={cfg.recompute!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    schedule = build_schedule(cfg.schedule, stages=cfg.pp, microbatches=cfg.microbatches, virtual=cfg.virtual_stages)
    if cfg.n_layers < schedule.num_stages:
        raise ConfigError(f"n_layers={cfg.n_layers} is fewer than the {schedule.num_stages} pipeline chunks")
    from plait.distributed.context import resolve_layout
    from plait.tensor_parallel.plan import check_llama_tp

    resolve_layout(cfg.world, cfg.tp, cfg.pp, cfg.dp, cfg.ep, cfg.expert_tp)
    if cfg.expert_tp and cfg.n_experts < 2:
        raise ConfigError("expert_tp=True needs a mixture-of-experts model: pass --experts E (E >= 2)")
    mcfg = _model_config(cfg)
    check_llama_tp(mcfg, cfg.tp)
    if cfg.ep > 1:
        from plait.experts import check_experts

        if cfg.n_experts < 2:
            raise ConfigError(f"ep={cfg.ep} needs a mixture-of-experts model: pass --experts E (E >= 2)")
        check_experts(cfg.n_experts, cfg.ep)
    if cfg.sequence_parallel and cfg.seq_len % cfg.tp:
        raise ConfigError(f"seq_len={cfg.seq_len} must be divisible by tp={cfg.tp} with sequence parallelism")
    if cfg.world > 16:
        raise ConfigError(f"tp*pp*dp={cfg.world} processes is too many for a local CPU check (max 16)")


def verify(cfg: VerifyConfig, timeout_s: float = 600.0) -> VerifyResult:
    """Launch ``cfg.world`` CPU processes (Gloo), run the check, return rank 0's comparison."""
    from plait.distributed.launch import run_world

    check(cfg)
    return run_world(_rank_main, cfg.world, cfg, timeout_s=timeout_s)[0]
