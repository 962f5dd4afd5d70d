"""``plait verify``: run a small Llama under a layout and on one device, and compare every tensor."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

from plait.errors import ConfigError, FieldError, is_integer, plain_numbers
from plait.parallel_config import ParallelConfig, batch_split
from plait.words import counted, either

if TYPE_CHECKING:
    from plait.distributed.context import ParallelContext

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # parallel equals single device: float32 rounding on losses and gradients
#: what the workers' fork server imports once (``run_world``'s ``preload``): each process of a check is forked with
#: them imported instead of importing torch itself (~2 s of CPU a process), and a caller's later checks (plait demo
#: runs two) fork from the same server
PRELOAD = ("torch", "plait", "plait.models", "plait.sim", "plait.verify")
#: the layout ``plait verify`` checks when no flag says otherwise (4 local processes, 1F1B)
VERIFY_PARALLEL = ParallelConfig(tp=2, pp=2, dp=1, microbatches=8)
DONE = "barrier at the end of plait verify's comparison"  # every rank waits there for rank 0's result
EOS = 0  #: the end-of-document token of the batch of ``document_mask`` (no other token of it is 0)


@dataclass
class VerifyConfig:
    """A layout (``parallel``) and the small random Llama it is checked on."""

    parallel: ParallelConfig = VERIFY_PARALLEL
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
    #: rows packed with several documents, each ending with ``EOS``, run with document masking (plait.documents)
    document_mask: bool = False
    window: int | None = None  # every layer's sliding window: a query sees at most this many keys (None: causal)

    def __post_init__(self) -> None:
        plain_numbers(self)

    @property
    def world(self) -> int:
        return self.parallel.world

    def to_dict(self) -> dict:
        """Flat: the layout's fields, then the model's."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "parallel"}
        return {**self.parallel.to_dict(), **own}


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
    def peaks_ok(self) -> bool:
        """Whether every pipeline rank's peak of stored activations is the simulator's."""
        return all(abs(a - b) < 1e-9 for a, b in zip(self.peak_measured, self.peak_simulated, strict=True))

    @property
    def ok(self) -> bool:
        return (self.loss_rel <= LOSS_TOL and all(g.ok for g in self.grads) and self.logits_rel <= LOSS_TOL
                and self.peaks_ok)

    def verdict(self) -> str:
        """What was compared with the single-device run and how close it came, each against its tolerance: the
        checks that failed first, named (the worst tensor, how many differ)."""
        worst = max(self.grads, key=lambda g: g.rel)
        bad = [g for g in self.grads if not g.ok]
        grads = (f"{len(bad)} of {counted(len(self.grads), 'gradient')} beyond rel {GRAD_TOL:.0e} (worst "
                 f"{worst.name} rel {worst.rel:.1e})" if bad else
                 f"{counted(len(self.grads), 'gradient')} within rel {GRAD_TOL:.0e} (worst {worst.name} rel "
                 f"{worst.rel:.1e})")
        checks = [(self.loss_rel <= LOSS_TOL, f"loss rel {self.loss_rel:.1e} {_within(self.loss_rel, LOSS_TOL)}"),
                  (not bad, grads),
                  (self.logits_rel <= LOSS_TOL, f"eval logits rel {self.logits_rel:.1e} "
                                                f"{_within(self.logits_rel, LOSS_TOL)}"),
                  (self.peaks_ok, "peak stored activations per pipeline rank " + (
                      "equal the simulator's" if self.peaks_ok else
                      f"{self.peak_measured}, the simulator's {self.peak_simulated}"))]
        failed = [text for ok, text in checks if not ok]
        if failed:
            return "FAIL: parallel differs from single device: " + "; ".join(failed)
        return "PASS: parallel equals single device: " + "; ".join(text for _, text in checks)

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "ok": self.ok, "verdict": self.verdict(),
                "loss_parallel": self.loss_parallel,
                "loss_single": self.loss_single, "loss_rel": self.loss_rel, "logits_rel": self.logits_rel,
                "peak_measured": self.peak_measured, "peak_simulated": self.peak_simulated,
                "grads": [{**asdict(g), "ok": g.ok} for g in self.grads]}


def _within(rel: float, tol: float) -> str:
    return f"{'<=' if rel <= tol else '>'} {tol:.0e}"


def _rel(a, b) -> tuple[float, float]:
    diff = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    return diff, diff / scale if scale > 0 else diff


def _model_config(cfg: VerifyConfig):
    from plait.models import LlamaConfig

    return LlamaConfig(vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                       n_kv_heads=cfg.n_kv_heads, max_seq_len=cfg.seq_len, tie_embeddings=cfg.tie_embeddings,
                       n_experts=cfg.n_experts, top_k=cfg.top_k, sliding_window=cfg.window)


def _batch(cfg: VerifyConfig):
    """Inputs and targets [batch_size, seq_len] of random tokens; with ``document_mask`` the tokens are 1.. and each
    row's inputs hold an EOS at about every eighth position (never the last), so a row packs several documents."""
    import torch

    gen = torch.Generator().manual_seed(cfg.seed + 1)
    low = 1 if cfg.document_mask else 0
    tokens = torch.randint(low, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
    if cfg.document_mask:
        for row in tokens:
            row[torch.randperm(cfg.seq_len - 1, generator=gen)[:max(1, cfg.seq_len // 8)]] = EOS
    return tokens[:, :-1], tokens[:, 1:]


def _each_document(model, inputs, targets):
    """The loss, with its backward run, and the logits of every document of ``inputs`` run alone through ``model``:
    a document ends with an EOS (included) or at its row's end; the target after an EOS is left out of the loss,
    which is the mean over the remaining targets."""
    import torch
    import torch.nn.functional as F

    total, count, logits = torch.zeros(()), 0, []
    for x_row, y_row in zip(inputs, targets, strict=True):
        cuts = [i + 1 for i, t in enumerate(x_row.tolist()[:-1]) if t == EOS]
        row = []
        for a, b in zip([0, *cuts], [*cuts, len(x_row)], strict=True):
            x, y = x_row[a:b][None], y_row[a:b].masked_fill(x_row[a:b] == EOS, -100)
            out = model(x)[0]
            row.append(out.detach())
            total = total + F.cross_entropy(out, y, ignore_index=-100, reduction="sum")
            count += int((y != -100).sum())
        logits.append(torch.cat(row))
    loss = total / count
    loss.backward()
    return loss, torch.stack(logits)


def _rank_main(cfg: VerifyConfig) -> VerifyResult | None:
    """Runs on every rank of the launched world; rank 0 returns the comparison."""
    import plait

    with plait.init(config=cfg.parallel) as ctx:
        return _compare(cfg, ctx)


def _compare(cfg: VerifyConfig, ctx: ParallelContext) -> VerifyResult | None:
    """One warm-up and one traced step under ``ctx`` against the model on one device (rank 0 returns it)."""
    import torch
    import torch.distributed as dist

    import plait
    from plait.distributed.collectives import collective
    from plait.models import Llama
    from plait.sim import Costs, simulate

    mcfg = _model_config(cfg)
    inputs, targets = _batch(cfg)
    torch.manual_seed(cfg.seed)
    reference = Llama(mcfg)
    if cfg.document_mask:
        ref_loss, ref_logits = _each_document(reference, inputs, targets)
    else:
        ref_loss, ref_logits = reference.loss(inputs, targets), None
        ref_loss.backward()
    torch.manual_seed(cfg.seed)
    # the settings of cfg.parallel, which ctx was made from
    pm = plait.parallelize(Llama(mcfg), ctx, document_eos=EOS if cfg.document_mask else None)
    per = cfg.batch_size // ctx.dp_size
    local = slice(ctx.dp_rank * per, (ctx.dp_rank + 1) * per)
    pm.train_step(inputs[local], targets[local])  # warm-up: the first step pays one-time set-up costs
    loss = pm.train_step(inputs[local], targets[local], trace=True)
    grads = pm.full_state_dict(grads=True)
    report = pm.trace_report()
    logits = pm.eval_step(inputs[local])
    if ctx.rank != 0:
        collective(DONE, None, dist.barrier)
        return None
    errors = []
    for name, p in reference.named_parameters():
        max_abs, rel = _rel(grads[name], p.grad)
        errors.append(TensorError(name, tuple(p.shape), max_abs, rel))
    _, logits_rel = _rel(logits, ref_logits[local] if ref_logits is not None else reference(inputs[local]).detach())
    sim = simulate(pm.schedule, Costs())
    collective(DONE, None, dist.barrier)
    return VerifyResult(cfg, loss, ref_loss.item(), errors, logits_rel, report.measured.peak_activations,
                        sim.peak_activations, report.to_text(68))


def check(cfg: VerifyConfig) -> None:
    """Raise ConfigError for a layout that cannot work, before launching anything.

    The layout's own rules were checked when ``cfg.parallel`` was built (plait.parallel_config).
    """
    from plait.models.llama import FAMILY

    par = cfg.parallel
    if par.dp == -1:
        raise FieldError("dp", -1, "plait verify launches tp*cp*pp*dp processes itself; give the count")
    if par.zero in (1, 2):
        raise FieldError("zero", par.zero, "shards only the optimizer's state (and gradients), and plait verify "
                                           "runs no optimizer step; use 0, or 3 (parameters sharded: checked here)")
    for name in ("batch_size", "n_layers", "seq_len", "n_experts"):
        value = getattr(cfg, name)
        if not is_integer(value) or value < 1:
            raise FieldError(name, value, "must be >= 1" if is_integer(value) else "must be an integer >= 1")
    if not 1 <= cfg.top_k <= cfg.n_experts:
        raise FieldError("top_k", cfg.top_k, "must be between 1 and the experts ({n_experts})",
                         {"n_experts": cfg.n_experts})
    if cfg.batch_size % par.dp or (cfg.batch_size // par.dp) % par.num_microbatches:
        unit = par.dp * par.num_microbatches
        per_replica, fits = batch_split(cfg.batch_size, par.dp)
        other = (f"; or, instead of {{microbatches}}, one that divides a replica's {per_replica} sequences: "
                 f"{either([str(m) for m in fits])}") if per_replica else ""
        raise FieldError("batch_size", cfg.batch_size, "must split into {dp} replicas of {microbatches} "
                         f"micro-batches each: valid {unit}, {2 * unit}, {3 * unit}, ...{other}",
                         {"dp": par.dp, "microbatches": par.num_microbatches})
    chunks = par.pipeline_schedule().num_stages
    if cfg.n_layers < chunks:
        raise FieldError("n_layers", cfg.n_layers, f"fewer than the {chunks} pipeline chunks (pp x virtual stages), "
                         f"each of which needs a layer: valid {chunks} or more")
    if (par.expert_tp or par.ep > 1) and cfg.n_experts < 2:
        name, value = ("ep", par.ep) if par.ep > 1 else ("expert_tp", True)
        raise FieldError(name, value, "needs a mixture-of-experts model, at least 2 experts (not {n_experts})",
                         {"n_experts": cfg.n_experts})
    if cfg.window is not None and not (is_integer(cfg.window) and cfg.window >= 1):
        raise FieldError("window", cfg.window, "must be an integer >= 1 (the keys a query sees, itself included)")
    if cfg.document_mask and cfg.n_experts > 1:
        raise FieldError("document_mask", True, "compares each document run alone, but a mixture of experts' "
                         "load-balancing loss is the packed row's: use --experts 1 (not {n_experts})",
                         {"n_experts": cfg.n_experts})
    mcfg = _model_config(cfg)
    try:
        FAMILY.check_tp(mcfg, par.tp)
    except FieldError:
        raise
    except ConfigError as exc:  # said of the model's fields: name the flag
        raise FieldError("tp", par.tp, f"does not fit plait verify's model ({exc})") from None
    if par.ep > 1:
        from plait.experts import check_experts

        check_experts(cfg.n_experts, par.ep)
    par.check_seq_len(cfg.seq_len)
    if par.sequence_parallel and cfg.seq_len % par.tp:
        raise FieldError("seq_len", cfg.seq_len, "must be divisible by {tp} with sequence parallelism", {"tp": par.tp})
    if cfg.world > 16:
        raise ConfigError(f"tp*cp*pp*dp={cfg.world} processes is too many for a local CPU check (max 16)")


def verify(cfg: VerifyConfig, timeout_s: float = 600.0) -> VerifyResult:
    """Launch ``cfg.world`` CPU processes (Gloo), run the check, return rank 0's comparison."""
    from plait.distributed.launch import run_world

    check(cfg)
    return run_world(_rank_main, cfg.world, cfg, timeout_s=timeout_s, preload=PRELOAD)[0]
