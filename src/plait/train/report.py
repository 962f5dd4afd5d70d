"""What rank 0 shows and writes during training: rich progress bar, JSON-lines metrics, summary table."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, TextIO

from plait.parallel_config import ParallelConfig
from plait.train.config import TrainConfig
from plait.train.logs import open_metrics
from plait.train.memory_table import memory_table
from plait.train.observe import NO_CLUSTER, PHASES, Prediction
from plait.words import counted, mesh

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from plait.train.logs import ExperimentLogs


# How far the host's speed probe (plait calibrate's: one linear layer on one thread for about 0.06 s) may
# read from its calibrated speed before the run says so. On an idle 2-core VM the probe's reading moves by
# about 12% (standard deviation over mean) from one second to the next, and it correlates weakly with the
# speed of the work that follows (docs/planner-log.md, entry 4); a reading within twice that says nothing about the run.
SPEED_NOTE = 0.3


def off_speed(pred: Prediction | None) -> bool:
    """Whether the probe at the run's start read further from its calibrated speed than its own noise."""
    return pred is not None and pred.host_speed is not None and abs(pred.host_speed - 1) > SPEED_NOTE


class Reporter:
    """Progress and metrics of a run; silent on every rank but 0."""

    def __init__(self, cfg: TrainConfig, rank: int, console=None):
        self.cfg, self.active = cfg, rank == 0
        self.metrics: TextIO | None = None
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.console = console
        self.last: dict = {}
        self.bubbles: tuple[float | None, float | None] = (None, None)
        self.logs: ExperimentLogs | None = None  # with --tensorboard / --wandb

    def begin(self, run) -> None:
        if not self.active:
            return
        from rich.console import Console

        self.console = self.console or Console(highlight=False)
        cfg = self.cfg
        if cfg.metrics:  # closed in end(); a resumed run appends to the rows of the steps before its checkpoint
            self.metrics = open_metrics(cfg.metrics, run.start if run.resumed_from is not None else None)
        if cfg.tensorboard or cfg.wandb:
            from plait.train.logs import ExperimentLogs

            self.logs = ExperimentLogs(cfg.tensorboard, cfg.wandb, cfg.to_dict(), run.start, cfg.checkpoint_dir,
                                      cfg.resume or cfg.auto_resume)
        self.console.print(
            f"[bold]plait train[/]: {cfg.model} ({run.pm.family.name}), "
            f"{run.params / 1e6:.2f}M parameters | {layout_text(run.ctx.config)}\n"
            f"data: {run.data.describe(cfg.document_mask)} | batch {cfg.batch_size} x {cfg.seq_len} tokens, "
            f"steps {run.start + 1}..{cfg.steps}" + (f" (resumed at {run.start})" if run.start else ""))
        if run.passed_over:  # never a silent fall-back past the checkpoint a user expects
            from rich.markup import escape

            from plait.train.restart import passed_over

            self.console.print(f"[yellow]note: {escape(passed_over(run.passed_over))}; passed over[/]")
        if run.resumed_from is not None:
            self.console.print(f"resuming from {run.resumed_from} (step {run.start})" + (
                f", saved under {run.resharded_from}: its weights and optimizer state resharded to this layout"
                if run.resharded_from else ""))
            if run.resume_note:
                self.console.print(run.resume_note)
        elif cfg.auto_resume:
            self.console.print(f"--auto-resume: no complete checkpoint in {cfg.checkpoint_dir}, starting fresh")
        if cfg.warmup >= cfg.steps:
            self.console.print(f"[yellow]note: --warmup {cfg.warmup} is not shorter than --steps {cfg.steps}: the "
                               f"learning rate rises the whole run, to {cfg.steps / cfg.warmup:.0%} of --lr "
                               f"{cfg.lr:g} at its last step, and never decays (give --warmup below --steps)[/]")
        if run.prediction is None and run.unpredicted and cfg.cluster != NO_CLUSTER:  # not asked for: say why
            self.console.print(f"[yellow]note: no prediction: {run.unpredicted}[/]")
        if run.prediction is not None:
            e = run.prediction
            self.console.print(f"predicted on {e.source}: step {e.step_time_s * 1e3:,.0f} ms, bubble "
                               f"{e.bubble:.1%} (idle share of the step), most loaded rank "
                               f"{e.peak_bytes / 2**20:,.1f} MiB")
            if off_speed(e):
                self.console.print(f"[yellow]note: plait calibrate's speed probe reads {e.host_speed:.2f}x the "
                                   "speed it had when this host was calibrated, more than the probe's own noise: "
                                   "the host is likely slower or faster now than then, and the step times may "
                                   "differ from the prediction (when it is steady: `plait calibrate` for this "
                                   "host's cached profile, `plait calibrate --out FILE` for a --cluster "
                                   "FILE)[/yellow]")
        self._start_bar(run.start)

    def complete(self, run) -> None:
        """Instead of the run: it resumed from a checkpoint at or past --steps, so there is nothing to train."""
        if self.active:
            from rich.console import Console

            from plait.train.restart import complete_message

            console = self.console or Console(highlight=False)
            console.print(complete_message(self.cfg, run.resumed_from, run.start), markup=False)

    def _start_bar(self, start: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        if not self.console.is_terminal:
            return
        progress = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                            TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.console,
                            transient=False)
        self.task = progress.add_task("train", total=self.cfg.steps, completed=start, info="starting")
        progress.start()
        self.progress = progress

    def doing(self, text: str) -> None:
        """Say what the run does between its steps' lines (the last checkpoint's save, the sample): in the bar's
        place on a terminal, else a line of the log."""
        if not self.active or self.console is None:
            return
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, info=text)
        else:
            self.console.print(text, soft_wrap=True, markup=False)

    def saved(self, folder: str, nbytes: int | None) -> None:
        """Say on a line of its own (above the bar on a terminal) that checkpoint ``folder`` of ``nbytes`` is saved,
        or, with --async-checkpoint, being written in the background."""
        if not self.active or self.console is None:
            return
        size = f" ({nbytes / 1e6:,.0f} MB of weights and optimizer state)" if nbytes is not None else ""
        how = f"writing {folder} in the background" if self.cfg.async_checkpoint else f"saved {folder}"
        self.console.print(how + size, soft_wrap=True, markup=False)

    def _info(self, row: dict) -> str:
        m, p = self.bubbles
        bub = f" | bubble {m:.0%}" + (f" (predicted {p:.0%})" if p is not None else "") if m is not None else ""
        pred = row.get("predicted_step_time_s")
        ms = f" | {row['step_time_s'] * 1e3:,.0f} ms" + (f" (predicted {pred * 1e3:,.0f})" if pred else "")
        loss = f"{row['loss']:.3f}" if row["loss"] is not None else "- (no target in the loss)"
        return f"loss {loss}{experts_text(row)} | {row['tokens_per_s']:,.0f} tok/s{ms}{bub}"

    def step(self, row: dict) -> None:
        if not self.active:
            return
        if "measured_bubble" in row:
            self.bubbles = (row["measured_bubble"], row.get("predicted_bubble"))
        self.last = row
        if self.metrics is not None:
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
        if self.logs is not None:
            self.logs.log(row)
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, completed=row["step"], info=self._info(row))
        elif row["step"] % max(1, self.cfg.steps // 10) == 0 or row["step"] == self.cfg.steps:
            self.console.print(f"step {row['step']:>5}/{self.cfg.steps} | {self._info(row)}",
                               soft_wrap=True)  # one line of the log a step, whatever the console's width

    def end(self, run, res) -> None:
        if not self.active:
            return
        if self.progress is not None:
            if self.last and self.task is not None:  # the last step's figures in place of what followed it
                self.progress.update(self.task, info=self._info(self.last))
            self.progress.stop()
        if self.metrics is not None:
            self.metrics.close()
        if self.logs is not None:
            self.logs.close()
            if self.logs.note:
                self.console.print(self.logs.note)
        self.console.print(summary_table(self.cfg, run, res))
        if res.memory:
            pred = run.prediction
            self.console.print(memory_table(res.memory, pred.memory if pred else None, pred.notes if pred else ()))
        if res.stopped_at is not None:
            self.console.print(f"[bold]stopped by {res.stop_signal}[/] after step {res.stopped_at}: checkpoint "
                               f"{res.checkpoint}; continue with --resume or --auto-resume")
        if res.sample is not None:
            from rich.panel import Panel
            from rich.text import Text

            self.console.print(Panel(Text(res.sample), title="sample (temperature 0.8, top-k 20)", expand=False))
        elif res.stopped_at is None and self.cfg.sample_tokens > 0:  # the layout shards the sequence
            par = self.cfg.parallel
            split = "--sequence-parallel" if par.sequence_parallel else f"--cp {par.cp}"
            self.console.print(f"no sample: {split} splits each sequence, which decoding one token at a time "
                               f"cannot; plait generate --model {res.checkpoint} samples the model")


def experts_text(row: dict) -> str:
    """A mixture of experts' step in the progress line (nothing for a dense model): the load-balancing loss
    (part of the loss shown), the busiest expert's assignments over the mean in the worst MoE layer, and the
    share of assignments the capacity limit dropped (when there is one)."""
    if row.get("aux_loss") is None:
        return ""
    by_layer: dict[str, float] = row["expert_imbalance_by_layer"]
    worst = max(by_layer, key=by_layer.__getitem__)
    where = f" (layer {worst})" if len(by_layer) > 1 else ""
    dropped = f", dropped {row['dropped_fraction']:.1%}" if row.get("dropped_fraction") is not None else ""
    return f" (aux {row['aux_loss']:.4f}) | experts max/mean {by_layer[worst]:.2f}{where}{dropped}"


def layout_text(p: ParallelConfig) -> str:
    """E.g. ``tp 2 x pp 2 x dp 1 (4 processes), interleaved-1f1b V=2, 4 micro-batches, recompute full``; at pp 1
    (no pipeline) without the schedule: ``tp 2 x pp 1 x dp 1 (2 processes), 1 micro-batch``; expert parallelism,
    experts split over TP, a ZeRO stage and bf16 where they are chosen (``..., ep 2, expert TP, ZeRO-3, bf16``)."""
    virtual = p.pipeline_schedule().virtual
    schedule = f", {p.schedule}{f' V={virtual}' if virtual > 1 else ''}" if p.pp > 1 else ""
    m = p.num_microbatches
    return (f"{mesh(p.tp, p.pp, p.dp, p.cp, p.cp_comm)} ({counted(p.world, 'process')}){schedule}"
            f", {counted(m, 'micro-batch')}"
            f"{', sequence parallel' if p.sequence_parallel else ''}"
            f"{f', recompute {p.recompute}' if p.recompute != 'none' else ''}"
            f"{f', ep {p.ep}' if p.ep > 1 else ''}{', expert TP' if p.expert_tp and p.tp > 1 else ''}"
            f"{f', ZeRO-{p.zero}' if p.zero else ''}"
            f"{f', {p.precision}' if p.precision != 'fp32' else ''}")


def _no_held_out(data, seq_len: int) -> str:
    """Why a run whose data has no held-out window shows no held-out loss: no held-out split, or one shorter than
    a window of ``seq_len + 1`` tokens."""
    short = data.short_held_out
    if not short:
        return "- (no held-out split)"
    tokens = " and ".join(f"{s.held_out.tokens:,}" for s in short)
    return (f"- (the held-out split's {tokens} tokens make no {seq_len + 1:,}-token window: a shorter --seq-len, "
            "or a larger --held-out in plait data prepare)")


def summary_table(cfg: TrainConfig, run, res):
    from rich.table import Table

    t = Table(title="plait train: summary", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    pred = run.prediction
    steps = sorted(res.losses)
    first, last = (res.losses[steps[0]], res.losses[steps[-1]]) if steps else (float("nan"),) * 2
    rows = [
        ("layout", layout_text(run.ctx.config)),
        ("steps", f"{steps[0] if steps else run.start}..{res.stopped_at or cfg.steps}"
         + (f" (stopped by {res.stop_signal}; --steps {cfg.steps})" if res.stopped_at is not None else "")
         + (f" (skipped {res.skipped})" if res.skipped else "")),
        ("loss", f"{first:.3f} -> {last:.3f}" + _no_targets(res.no_targets)),
        ("held-out loss", f"{res.held_out:.3f}" if res.held_out is not None else
         _no_held_out(run.data, cfg.seq_len) if run.data.eval_order is None else
         f"- (not measured: stopped by {res.stop_signal})" if res.stopped_at is not None else
         "- (no held-out target in the loss)"),
        ("data", _data_line(run, cfg.steps if res.stopped_at is None else res.stopped_at)),
        ("throughput", _throughput(res)),
        ("step time", _vs(res.step_time_s * 1e3, pred.step_time_s if pred else None, 1e3, "ms", run.unpredicted)
         + _at_speed(res, pred)),
        ("step by phase", _phases(res, pred)),
        ("bubble", _bubbles(res, pred, cfg.trace_every if run.ctx.config.pp > 1 else None)),
        ("start-up", f"{res.startup_s:.1f} s to the end of the first step"),
        ("checkpoint", (res.checkpoint or "-") + _blocked(cfg, res)),
    ]
    load = getattr(getattr(run, "pm", None), "last_expert_load", None)  # a ParallelModel's (stand-ins have none)
    if load is not None:
        rows.insert(3, ("experts", _experts_summary(load.row())))
    for k, v in rows:
        t.add_row(k, v)
    return t


def _experts_summary(row: dict) -> str:
    """The last step's routing (a mixture of experts): load-balancing loss, imbalance, dropped share."""
    by_layer: dict[str, float] = row["expert_imbalance_by_layer"]
    worst = max(by_layer, key=by_layer.__getitem__)
    dropped = "" if row["dropped_fraction"] is None else f"; {row['dropped_fraction']:.1%} of assignments dropped"
    return (f"last step: load-balancing loss {row['aux_loss']:.4f} (in the loss); busiest expert "
            f"{by_layer[worst]:.2f}x the mean (layer {worst}){dropped}")


def _throughput(res) -> str:
    """Tokens per second and the median step they come from, in ms grouped by thousands as the step-time row."""
    return f"{res.tokens_per_s:,.0f} tokens/s (median step {res.step_time_s * 1e3:,.0f} ms)"


def _no_targets(steps: list[int]) -> str:
    """The steps whose batch had no target in the loss (every one outside the chat loss mask)."""
    if not steps:
        return ""
    shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
    one = len(steps) == 1
    return (f"; {counted(len(steps), 'step')} had no target in the loss ({'step' if one else 'steps'} {shown}: "
            f"{'its batch holds' if one else 'their batches hold'} no assistant token; "
            f"{'its gradients were' if one else 'their gradients were'} zero)")


def _blocked(cfg: TrainConfig, res) -> str:
    """How long the step loop waited per checkpoint saved during the run."""
    b = res.checkpoint_blocked_s
    if not b:
        return ""
    how = "written in the background" if cfg.async_checkpoint else "written in the loop (--no-async-checkpoint)"
    return (f"; {counted(len(b), 'save')} during the run, the step loop blocked {sum(b) / len(b) * 1e3:,.0f} ms "
            f"per save (max {max(b) * 1e3:,.0f} ms; {how})")


def _data_line(run, steps: int) -> str:
    """Tokens seen and passes over the data after ``steps`` steps."""
    pos = run.data.position(steps)
    per = "".join(f", {name} {e:.3g}" for name, e in pos.get("epochs", {}).items())
    return f"{pos['tokens_seen']:,} tokens seen, epoch {pos['epoch']:.3g}" + (f" (by source{per[1:]})" if per else "")


def _at_speed(res, pred: Prediction | None) -> str:
    """The prediction at the host's speed when the run started (the calibration's probe taken again), when
    the probe read further from its calibrated speed than its own noise (``SPEED_NOTE``)."""
    if pred is None or pred.host_speed is None or not pred.step_time_s or not off_speed(pred):
        return ""
    at = pred.step_time_s / pred.host_speed * 1e3
    return (f"; the host ran at {pred.host_speed:.2f}x its calibrated speed at the start, where the prediction is "
            f"{at:,.0f} ms (measured/that {res.step_time_s * 1e3 / at:.2f})")


# how the summary names the phases of ``plait.train.observe.PHASES``
PHASE_NAMES = {"forward_backward": "forward-backward", "grad_reduction": "gradient reduction"}


def median_phases(steps: list[dict[str, float]]) -> dict[str, float]:
    """The median seconds in each phase (``plait.train.observe.PHASES``) over ``steps``, each a step's seconds
    by phase; the upper of the middle two when they are even in number, as the step time's median."""
    out = {}
    for k in PHASES:
        vals = sorted(p[k] for p in steps if k in p)
        if vals:
            out[k] = vals[len(vals) // 2]
    return out


def _phases(res, pred: Prediction | None) -> str:
    """Median ms per phase of the step (rank 0's), each beside the planner's figure for it."""
    measured = median_phases(res.phases[1:] or res.phases)  # the steps after the first, as the step time
    if not measured:
        return "-"
    predicted = pred.phases if pred is not None else {}
    parts = []
    for k, v in measured.items():
        p = predicted.get(k)
        parts.append(f"{PHASE_NAMES.get(k, k)} {v * 1e3:,.0f}" + (f" ({p * 1e3:,.0f})" if p is not None else ""))
    return " | ".join(parts) + (" ms, measured (predicted)" if predicted else " ms")


def _vs(measured: float, predicted: float | None, scale: float, unit: str, unpredicted: str | None = None) -> str:
    """The measured figure beside the predicted one, or beside why nothing was predicted (``unpredicted``)."""
    if predicted is None:
        return f"measured {measured:,.0f} {unit} (no prediction{f': {unpredicted}' if unpredicted else ''})"
    pred = predicted * scale
    return f"measured {measured:,.0f} {unit}, predicted {pred:,.0f} {unit} (measured/predicted {measured / pred:.2f})"


def _bubbles(res, pred: Prediction | None, trace_every: int | None) -> str:
    """Idle share of the step: measured on the last traced step, the same step simulated with its measured
    costs, and the planner's prediction; where a pipeline (``trace_every`` not None: the run's --trace-every) traced
    no step, why it was not measured."""
    parts = []
    if res.measured_bubble is not None:
        parts.append(f"measured {res.measured_bubble:.1%}, simulated from its costs {res.simulated_bubble:.1%}")
    if pred is not None:
        parts.append(f"predicted {pred.bubble:.1%}")
    n, why = trace_every, None
    if res.measured_bubble is None and n is not None:
        why = ("not measured: --trace-every 0 traces no step" if n == 0 else
               f"not measured: --trace-every {n} traces steps {n}, {2 * n}, ...: this run reached none of them")
    if not parts:
        return f"- ({why or 'no pipeline traced'})"
    return ", ".join(parts) + " (idle share of the step)" + (f"; {why}" if why else "")
