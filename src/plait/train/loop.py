"""The training loop one rank runs: model, layout, optimizer, data, resume, steps, checkpoints, sample."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait.checkpoint.shards import init_local, load_local
from plait.data.stream import EVAL_BATCHES, IGNORE
from plait.devices import synchronize
from plait.distributed.collectives import collective
from plait.train.config import PRESETS, TrainConfig, model_config, model_family
from plait.train.logs import experts_row
from plait.train.observe import NO_PREDICTION
from plait.train.resume import data_paths, resume

if TYPE_CHECKING:
    from plait.checkpoint import AsyncCheckpointer
    from plait.data.stream import TrainData
    from plait.distributed.context import ParallelContext
    from plait.optim import ParallelOptimizer
    from plait.parallel_model import ParallelModel
    from plait.tokenizers import ByteTokenizer, FileTokenizer
    from plait.train.observe import Prediction, Predictor


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite (the run stops unless ``--on-nonfinite skip``)."""


@dataclass
class TrainResult:
    """What a run reports (the same on every rank)."""

    losses: dict[int, float] = field(default_factory=dict)  # step -> global mean loss
    held_out: float | None = None
    checkpoint: str | None = None
    sample: str | None = None
    skipped: list[int] = field(default_factory=list)
    # steps whose global batch had no target in the loss (chat masks): no loss to show, none in ``losses``
    no_targets: list[int] = field(default_factory=list)
    tokens_per_s: float = 0.0
    step_time_s: float = 0.0
    measured_bubble: float | None = None  # idle share of the step, measured on the last traced step
    simulated_bubble: float | None = None  # the same step simulated with its measured action costs
    phases: list[dict[str, float]] = field(default_factory=list)  # per step: this rank's seconds by phase
    startup_s: float = 0.0
    params: int = 0
    checkpoint_blocked_s: list[float] = field(default_factory=list)  # per save in the loop: the loop's wait
    stopped_at: int | None = None  # the step a stop signal (SIGTERM, SIGINT) ended the run at, with a checkpoint
    stop_signal: str | None = None
    memory: list[dict] = field(default_factory=list)  # per rank: memory_rows()


@dataclass
class Run:
    """Everything the loop needs, built once."""

    cfg: TrainConfig
    ctx: ParallelContext
    pm: ParallelModel
    opt: ParallelOptimizer | torch.optim.Optimizer
    data: TrainData
    tokenizer: ByteTokenizer | FileTokenizer
    params: int
    start: int = 0
    resumed_from: str | None = None  # the checkpoint the run continued from (--resume, --auto-resume)
    resume_note: str | None = None  # the header's line on the settings changed since that checkpoint (resume_note)
    passed_over: list[str] = field(default_factory=list)  # newer checkpoint folders a resume found incomplete
    resharded_from: str | None = None  # the layout of the checkpoint it resumed, where it differs from the run's
    last_save: float = field(default_factory=time.monotonic)  # when the last save began (--checkpoint-every-minutes)
    saver: AsyncCheckpointer | None = None  # --async-checkpoint: writes in the background
    prediction: Prediction | None = None  # what the run's Predictor predicted (plait.train.observe)
    unpredicted: str | None = None  # when it predicted nothing, why ("--cluster none"; None: not said)


def build(cfg: TrainConfig, ctx: ParallelContext) -> Run:
    """Layout, model (preset or Hugging Face folder, each rank reading its slices), optimizer and data, under
    ``ctx`` (its caller owns it and closes it)."""
    import plait
    from plait.data.stream import open_data
    from plait.tokenizers import tokenizer_for

    torch.manual_seed(cfg.seed)
    mcfg = model_config(cfg)
    with torch.device("meta"):  # each rank allocates only its own shards, filled below one tensor at a time
        model = model_family(cfg).model_class(mcfg)
    params = model.num_parameters()
    data = open_data(cfg.data, cfg.model, mcfg.vocab_size, cfg.seq_len, cfg.batch_size, cfg.seed, cfg.max_data_mb)
    pm = plait.parallelize(model, ctx, config=cfg.parallel, document_eos=data.document_eos(cfg.document_mask))
    if cfg.model in PRESETS:  # seeded per tensor: the same weights in every layout (plait.models.init)
        init_local(pm, cfg.seed)
    else:  # a Hugging Face folder: each rank reads its slices
        from plait.models.hf import HFWeights

        load_local(pm, HFWeights(cfg.model).read)
    opt = make_optimizer(pm, cfg)
    tok = tokenizer_for(cfg.model)
    run = Run(cfg, ctx, pm, opt, data, tok, params)
    if cfg.resume or cfg.auto_resume:
        resume(run)
    return run


def make_optimizer(pm: ParallelModel, cfg: TrainConfig) -> ParallelOptimizer:
    """plait.optim's ParallelOptimizer (AdamW, warm-up + cosine LR, global-norm clip, ZeRO-1, bf16)."""
    from plait.optim import build_optimizer

    precision = None if cfg.parallel.precision == "fp32" else cfg.parallel.precision
    return build_optimizer(pm, lr=cfg.lr, weight_decay=cfg.weight_decay, zero=cfg.parallel.zero, precision=precision,
                           clip=cfg.clip if cfg.clip > 0 else None, warmup=cfg.warmup, total_steps=cfg.steps)


def save(run: Run, step: int) -> tuple[str, int | None]:
    """Save a checkpoint of step ``step`` (collective); returns its folder, in place once the write is done, and
    on rank 0 its bytes (``tensor_bytes``; None on the others)."""
    from plait.checkpoint import AsyncCheckpointer, CheckpointReader, save_checkpoint
    from plait.checkpoint.writer import tensor_bytes
    from plait.tokenizers import tokenizer_record

    extra = {"model": model_config(run.cfg).to_dict(), "family": run.pm.family.name, "train": run.cfg.to_dict(),
             "tokenizer": {**tokenizer_record(run.cfg.model), "eos": run.data.eos},  # where its documents end
             "data": {"next_step": step, "seed": run.cfg.seed, "source": run.data.describe(),
                      "paths": data_paths(run.cfg.data), **run.data.saved_counts(step)}}
    run.last_save = time.monotonic()
    if not run.cfg.async_checkpoint:
        folder = save_checkpoint(run.pm, run.opt, run.cfg.checkpoint_dir, step, extra, keep=run.cfg.keep)
        return str(folder), tensor_bytes(CheckpointReader(folder).meta["tensors"]) if run.ctx.rank == 0 else None
    run.saver = run.saver or AsyncCheckpointer()
    return str(run.saver.save(run.pm, run.opt, run.cfg.checkpoint_dir, step, extra, keep=run.cfg.keep)), \
        run.saver.nbytes


def timed_save(run: Run, res: TrainResult, step: int, reporter, row: dict | None = None, loop: bool = True) -> None:
    """A save, said to ``reporter`` before it starts (``doing``) and once it is saved or being written (``saved``);
    one inside the step ``loop`` records the time the loop was blocked by it (in ``res`` and the metrics row)."""
    if reporter is not None:
        reporter.doing(f"saving the checkpoint of step {step} in {run.cfg.checkpoint_dir} ...")
    t0 = time.perf_counter()
    res.checkpoint, nbytes = save(run, step)
    blocked = time.perf_counter() - t0
    if reporter is not None:
        reporter.saved(res.checkpoint, nbytes)
    if loop:
        res.checkpoint_blocked_s.append(blocked)
    if row is not None:
        row["checkpoint_blocked_s"] = blocked


def train_one(run: Run, step: int, trace: bool, phases: dict[str, float] | None = None
              ) -> tuple[float, float | None]:
    """One optimizer step on global batch ``step``; returns (loss, grad norm). Non-finite losses per policy.

    ``phases``, if given, receives this rank's seconds in each phase of the step (the keys of
    ``plait.train.observe.PHASES``): the batch and the forward/backward schedule, then the wait for the
    gradient reduction and the loss's sum, then the optimizer step (the gradient norm's sum included)."""
    ctx, cfg = run.ctx, run.cfg
    t0 = time.perf_counter()
    x, y = run.data.batch(step, (ctx.dp_rank, ctx.dp_size))  # this replica's rows of global batch ``step``
    loss = run.pm.train_step(x, y, trace=trace)
    t1 = time.perf_counter()
    if not math.isfinite(loss):
        if cfg.on_nonfinite == "stop":
            raise NonFiniteLoss(f"non-finite loss ({loss}) at step {step + 1}: stopping (lower --lr, or pass "
                                "--on-nonfinite skip to skip such steps)")
        run.pm.zero_grad()
        norm = None
    else:
        norm = run.opt.step()
    if phases is not None:
        synchronize(ctx.device)  # on a GPU the optimizer's kernels are only queued when step() returns
        ended = run.pm.last_stats.ended_at if run.pm.last_stats is not None else t1
        phases.update(forward_backward=ended - t0, grad_reduction=t1 - ended, optimizer=time.perf_counter() - t1)
    return loss, norm


def bubble(run: Run, step_s: float) -> tuple[float, float]:
    """(measured, simulated-with-measured-costs) bubble of the last traced step, each the idle share of
    the step: the average pipeline rank's idle time over the step's ``step_s`` (collective over PP)."""
    report = run.pm.trace_report()
    measured, simulated = report.measured, report.simulated
    idle = sum(measured.idle) / len(measured.idle) / 1e3  # the trace is in milliseconds
    sim_idle = sum(simulated.idle) / len(simulated.idle) / 1e3
    sim_step = step_s - measured.makespan / 1e3 + simulated.makespan / 1e3  # its own pipeline part instead
    return idle / step_s, sim_idle / sim_step if sim_step > 0 else 0.0


@torch.no_grad()
def held_out_loss(run: Run, batches: int = EVAL_BATCHES) -> float | None:
    """Mean next-token loss over the same held-out batches every time (None without a held-out split, or when
    no target of those batches is in the loss): each data-parallel replica its own rows (eval_step gives full
    logits on every rank), summed over replicas."""
    ctx = run.ctx
    total = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # [loss sum, tokens]
    for i in range(batches):
        part = run.data.held_out_batch(i, (ctx.dp_rank, ctx.dp_size))
        if part is None:
            return None
        x, y = part
        logits = run.pm.eval_step(x)  # [B/dp, S, V]
        y = run.pm.documents.mask_targets(x, y.to(logits.device))  # --document-mask: as train_step's
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum",
                                             ignore_index=IGNORE)  # targets outside a chat loss mask
        total[0] += ce.double()
        total[1] += (y != IGNORE).sum()
    if ctx.dp_size > 1:
        collective("dp all-reduce of the held-out loss", ctx.dp_group,
                   lambda: dist.all_reduce(total, group=ctx.dp_group))
    return float(total[0] / total[1]) if total[1] > 0 else None  # None: no held-out target in the loss


#: the sample's prompt on the default data, the Python standard library's sources
CODE_PROMPT = "def "


def sample_text(run: Run, doing: Callable[[str], None]) -> str | None:
    """A sample of the trained model, prompted by the start of a document of --data (``TrainData.prompt``: a
    conversation up to the assistant's reply, found in the first half of the model's context, or a text's first
    tokens), ``CODE_PROMPT`` without --data. It ends where ``plait generate`` ends a continuation of the
    checkpoint: before the model folder's end-of-sequence ids or the data's end-of-document token
    (plait.generation.job.stop_ids; decoding stops there). ``doing`` is told before the decoding starts."""
    from plait.generation import Sampling, generate_ids
    from plait.generation.decode import context_length
    from plait.generation.job import stop_ids
    from plait.tokenizers import tokenizer_record

    par = run.cfg.parallel
    if par.sequence_parallel or par.cp > 1 or run.cfg.sample_tokens <= 0:
        return None  # decoding one token at a time cannot shard the sequence; use plait generate
    doing(f"sampling up to {run.cfg.sample_tokens} tokens ...")
    context = context_length(run.pm) or 2 * run.cfg.seq_len
    prompt = run.data.prompt(context // 2) if run.cfg.data else run.tokenizer.encode(CODE_PROMPT)
    room = context - len(prompt)  # at least half the context for the sample
    new = min(run.cfg.sample_tokens, room)
    stop = stop_ids(tokenizer_record(run.cfg.model)["folder"], run.data.eos)  # the folder a checkpoint records
    ids = generate_ids(run.pm, [prompt], Sampling(new, temperature=0.8, top_k=20, seed=run.cfg.seed),
                       stop_ids=stop)[0]
    ended = len(ids) < new  # cut before a stop token: what follows is no continuation of the document
    return run.tokenizer.decode(prompt + ids) + ("\n[the sample ends: end-of-sequence token]" if ended else "")


def train(cfg: TrainConfig, ctx=None, reporter=None, stop=None, predictor: Predictor | None = None) -> TrainResult:
    """Run the whole loop on this rank (every rank of the world calls it).

    ``predictor`` (``plait.train.observe.Predictor``), if given, predicts the run once it is built; its figures
    go beside the measured ones in the metrics rows and the reporter's output.
    ``stop`` (a ``plait.train.preempt.StopRequest``): checked at every step boundary (all ranks agree); once
    a stop signal arrived, the run saves a checkpoint at that step and returns (no held-out loss, no sample).
    Without ``ctx`` the run makes its own from ``cfg.parallel`` and closes it when it ends.
    """
    t_start = time.perf_counter()
    if ctx is not None:
        return _train(cfg, ctx, reporter, stop, predictor, t_start)
    import plait

    with plait.init(config=cfg.parallel) as own:
        return _train(cfg, own, reporter, stop, predictor, t_start)


def _train(cfg: TrainConfig, ctx: ParallelContext, reporter, stop, predictor: Predictor | None,
           t_start: float) -> TrainResult:
    """The run; rank 0 holds --checkpoint-dir's lock throughout (plait.checkpoint.lock: one run to a folder)."""
    from contextlib import nullcontext

    from plait.checkpoint.lock import hold_folder

    with hold_folder(cfg.checkpoint_dir) if ctx.rank == 0 else nullcontext():
        return _train_held(cfg, ctx, reporter, stop, predictor, t_start)


def _train_held(cfg: TrainConfig, ctx: ParallelContext, reporter, stop, predictor: Predictor | None,
                t_start: float) -> TrainResult:
    run = build(cfg, ctx)
    if stop is not None:  # from here a stop signal saves a checkpoint; before, it ends the process at once
        stop.install()  # (a worker stopped while it waits for a dead peer in the rendezvous leaves promptly)
    res = TrainResult(params=run.params)
    if run.start >= cfg.steps:  # resumed from a checkpoint at or past --steps: the run is complete
        res.checkpoint = run.resumed_from
        if reporter is not None:
            reporter.complete(run)
        return res
    run.prediction = predictor.predict(run) if predictor is not None else None
    if reporter is not None:
        reporter.begin(run)
    times: list[float] = []
    for step in range(run.start, cfg.steps):
        row = _step(run, res, step, times, t_start, reporter)
        if reporter is not None:
            reporter.step(row)
        if stop is not None and stop.agreed(run.ctx):
            res.stopped_at, res.stop_signal = step + 1, stop.name
            if res.checkpoint is None or not res.checkpoint.endswith(f"step_{step + 1:08d}"):
                timed_save(run, res, step + 1, reporter)
            break
    res.memory = memory_rows(run.pm)
    _finish(run, res, times, reporter)
    if reporter is not None:
        reporter.end(run, res)
    return res


def _step(run: Run, res: TrainResult, step: int, times: list[float], t_start: float, reporter) -> dict:
    """Train global batch ``step``, with its trace, held-out loss and checkpoint when due; the metrics row."""
    cfg = run.cfg
    trace = cfg.trace_every > 0 and run.ctx.pp_size > 1 and step % cfg.trace_every == cfg.trace_every - 1
    lr = getattr(run.opt, "lr", cfg.lr)  # the rate this step's update uses
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    loss, norm = train_one(run, step, trace, phases)
    dt = time.perf_counter() - t0
    if step == run.start:  # from the command's start when launched by plait train, else this process's
        began = os.environ.get("PLAIT_LAUNCHED_AT")
        res.startup_s = time.time() - float(began) if began else time.perf_counter() - t_start
    times.append(dt)
    shown: float | None = loss
    if run.pm.last_loss_targets == 0:  # every target outside the loss mask: the 0.0 is no mean, not a loss
        res.no_targets.append(step + 1)
        shown = None
    else:
        res.losses[step + 1] = loss
    if norm is None and not math.isfinite(loss):
        res.skipped.append(step + 1)
    pred = run.prediction
    row = {"step": step + 1, "loss": shown, **run.data.position(step + 1),
           "tokens_per_s": cfg.batch_size * cfg.seq_len / dt, "step_time_s": dt, "lr": lr, "grad_norm": norm,
           "phase_s": phases, **(pred.row() if pred is not None else NO_PREDICTION), **experts_row(run.pm)}
    res.phases.append(phases)
    if trace:
        res.measured_bubble, res.simulated_bubble = bubble(run, dt)
        row.update(measured_bubble=res.measured_bubble, simulated_bubble=res.simulated_bubble)
    if step == run.start:  # the first step measured the memory (activations' peak included): both, per rank
        res.memory = memory_rows(run.pm)
        row["memory"] = {"predicted": pred.memory if pred is not None else [], "measured": res.memory}
        if pred is not None and pred.host_speed is not None:
            row["host_speed"] = pred.host_speed
    if cfg.eval_every > 0 and (step + 1) % cfg.eval_every == 0:
        row["held_out_loss"] = held_out_loss(run)
    if step + 1 < cfg.steps and (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
                                 or _minutes_due(run)):
        timed_save(run, res, step + 1, reporter, row)
    return row


def _minutes_due(run: Run) -> bool:
    """Whether --checkpoint-every-minutes has passed since the last save, by rank 0's clock (collective over
    the world when the option is set: every rank takes the same answer)."""
    if run.cfg.checkpoint_every_minutes <= 0:
        return False
    due = time.monotonic() - run.last_save >= 60 * run.cfg.checkpoint_every_minutes
    flag = torch.tensor([float(due)], device=run.ctx.device)
    if run.ctx.world_size > 1:
        collective("broadcast of rank 0's checkpoint clock", run.ctx.world_group,
                   lambda: dist.broadcast(flag, src=0, group=run.ctx.world_group))
    return bool(flag.item())


def memory_rows(pm) -> list[dict]:
    """Every rank's ``pm.memory_report()`` with its coordinates, in rank order (collective over the world)."""
    ctx = pm.ctx
    mine = {"rank": ctx.rank, "pp": ctx.pp_rank, "dp": ctx.dp_rank, "cp": ctx.cp_rank, "tp": ctx.tp_rank,
            **pm.memory_report()}
    if ctx.world_size == 1:
        return [mine]
    rows: list = [None] * ctx.world_size
    collective("all-gather of the ranks' memory reports", None, lambda: dist.all_gather_object(rows, mine))
    return rows


def _finish(run: Run, res: TrainResult, times: list[float], reporter) -> None:
    """The work after the last step: its checkpoint, the held-out loss, the sample, each said to ``reporter``
    (``Reporter.doing``: a minute or more for a large model, after the last step's line)."""
    cfg = run.cfg
    doing: Callable[[str], None] = reporter.doing if reporter is not None else lambda text: None
    steady = sorted(times[1:] or times)
    if steady:
        res.step_time_s = steady[len(steady) // 2]
        res.tokens_per_s = cfg.batch_size * cfg.seq_len / res.step_time_s
    if res.stopped_at is None:  # (stopped by a signal: the checkpoint is saved, leave promptly)
        if cfg.steps > run.start or run.resumed_from is None:
            timed_save(run, res, cfg.steps, reporter, loop=False)
        if run.data.eval_order is not None:
            doing("measuring the held-out loss ...")
        res.held_out = held_out_loss(run)  # while the last checkpoint is written
        res.sample = sample_text(run, doing)
    if run.saver is not None:
        if run.saver.pending:
            doing(f"writing the checkpoint {res.checkpoint} ...")
        run.saver.wait_all()  # the last checkpoint in place (on every rank) before the run reports it
