"""``plait calibrate``: measure this host's kernels and collectives, write the profile plan and train read."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# How far the host's speed probes may move during a calibration ((max - min) / mean) before the summary
# warns. The probe alone reads 12-17% apart (standard deviation over mean) from one second to the next on an
# idle 2-core VM (docs/planner-log.md, entry 4), so the dozen or so probes of a calibration span 40-60% with no drift at
# all; a wider span is the host moving.
STEADY = 0.6


HELP = f"""Measure this host with plait's own processes and write a cluster profile (TOML).

For each process count (default 1, 2 and 4) it measures what one process gets with the thread count
`plait train` gives it, alone and with every process busy (in pairs a moment apart): matmul, causal
attention and element-wise FLOP/s or bytes/s, the fixed cost of a kernel, memory bandwidth, two real
decoder layers (whose seconds, alone and shared, set the level of the kernels' figures: kernels run
slower in a step than in their own loops; and with their attention cores recomputed, what selective
recomputation costs), the optimizer step, and the time of all-reduce, all-gather,
reduce-scatter, all-to-all and point-to-point over every group size, from 1 KB to 4 MB; then a
tensor-parallel decoder layer over every group size, beside its compute twin (the same kernels without
collectives, which sets a sharded layer's level) and its collectives alone: what it takes beyond them is
the wait each tensor-parallel collective of a run adds; and where the processes outnumber the cores, a
two-stage pipeline of the larger layer beside its twin (how much the stages' hand-offs slow a crowded
host). Between its phases it probes the host's speed (one
linear layer on one thread) and scales each phase to the mean speed; it warns when the probes spread
more than {STEADY:.0%} (beyond their own noise: a busy host, or a virtual machine's neighbours). Takes
about a minute: 52-56 s on a quiet 2-core VM for the default 1, 2 and 4 processes, longer for more
process counts or larger ones, N times that with `--repeat N`, and longer on a busy host (other jobs
slow its processes' start-up and the least rounds each figure takes). Progress goes to standard error:
a bar on a terminal, else (a pipe, a CI log) a line a phase (matmul, attention, ..., each collective):
the figures measured of the total, the seconds since the start, the latest figure. On a host whose
speed moves, `--repeat N` keeps
the mean of N calibrations, and `--add` averages a new one into the profile's earlier ones (take them at
different moments): the profile then predicts the host's average, not one minute of it.
`plait plan --cluster FILE` plans with it; `plait train` predicts its own step with it (by default from
this host's cached profile, made on first use). It measures CPU hosts: on a host with a GPU it stops with
an error, since its kernel sizes stay far below what a GPU needs to reach its speed; there `plait train`
predicts with the planner's GPU model of that GPU, and `plait plan --gpu NAME` plans with it.

\b
Examples:
  plait calibrate --out host.toml
  plait calibrate --out host.toml --add       # later: averaged with the first
  plait calibrate --out host.toml --repeat 3  # three back to back: the mean
  plait calibrate --processes 1 --processes 2 --processes 4 --processes 8
  plait plan --model small --gpus 4 --cluster host.toml --global-batch 16 \\
      --seq-len 128
"""


def calibrate_command(
    out: Annotated[Path | None, typer.Option(help="Where to write the profile (default: this host's cache, "
                                                  "which plait train reads).")] = None,
    processes: Annotated[list[int] | None, typer.Option(help="Process counts to measure (repeatable; "
                                                             "default 1, 2, 4).")] = None,
    repeat: Annotated[int, typer.Option(min=1, help="Calibrate this many times back to back and keep the mean "
                                                    "(about a minute each): steadier on a host whose speed "
                                                    "moves.")] = 1,
    add: Annotated[bool, typer.Option("--add", help="Average with the calibrations the profile already holds "
                                                    "(weighted by their count) instead of replacing them: "
                                                    "calibrate at several moments, predict the host's "
                                                    "average. The profile must exist (make it without "
                                                    "--add).")] = False,
) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from plait.calibrate import DEFAULT_PROCESSES, calibrate
    from plait.distributed.launch import LaunchError
    from plait.errors import ConfigError, check_output_path, flag_message

    counts = tuple(processes or DEFAULT_PROCESSES)
    if min(counts) < 1:
        typer.echo("error: --processes: give counts >= 1", err=True)
        raise typer.Exit(2)
    try:
        check_output_path("--out", None if out is None else str(out), folder=False)  # before a minute of measuring
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    console, err = Console(), Console(stderr=True)
    lines = None if err.is_terminal else PhaseLines()  # off a terminal the bar shows nothing: a line a phase
    with Progress(TextColumn("[bold]calibrating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=err, transient=True, disable=lines is not None) as bar:
        task = bar.add_task("launching processes", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)
            if lines is not None:
                lines(done, total, what)

        try:
            profile, path = calibrate(counts, out, progress, repeat=repeat, add=add)
        except ConfigError as exc:  # e.g. --add to a profile measured another way
            typer.echo(f"error: {flag_message(exc)}", err=True)
            raise typer.Exit(2) from None
        except LaunchError as exc:  # a measuring process died or stopped answering: which one, in one line
            typer.echo(f"error: plait calibrate: {str(exc).splitlines()[0]}", err=True)
            raise typer.Exit(1) from None
    _summary(console, profile, path)


class PhaseLines:
    """Progress as lines on standard error, for a pipe or a log: one a phase, at its first figure measured (where
    ``what``, its numbers aside, changes: "matmul 512x512x512" to "attention s=512 d=64"), with the figures
    measured of the total and the seconds since the start."""

    def __init__(self) -> None:
        import time

        self.clock, self.start, self.phase = time.monotonic, time.monotonic(), ""

    def __call__(self, done: int, total: int, what: str) -> None:
        import re

        phase = re.sub(r"\d+", "#", what)
        if phase != self.phase:
            self.phase = phase
            seconds = self.clock() - self.start
            typer.echo(f"plait calibrate: {done} of {total} measured, {seconds:.0f} s: {what}", err=True)


def _summary(console, profile, path: Path) -> None:
    from rich import box
    from rich.table import Table

    from plait.calibrate.kernels import REFERENCE_SHAPE
    from plait.plan.host.costs import HostCosts
    from plait.words import counted

    # columns one space apart (the box's), each header's words on lines of their own: in 80 columns (a terminal, a
    # log) every header and figure is whole
    t = Table(title=f"{profile.name}: {profile.host.get('cpu')}, {counted(profile.cores, 'core')} ({path})",
              header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, padding=0)
    for col in ("procs", "threads", "GEMM\nGFLOP/s\nalone", "GEMM\nGFLOP/s\nshared", "attention\nGFLOP/s",
                "element-\nwise\nGB/s", "kernel\nµs", "all-\nreduce\n1 MB ms", "TP wait\n1 MB ms"):
        t.add_column(col, justify="right", min_width=max(map(len, col.split("\n"))))
    for p in sorted(profile.sections):
        s = profile.sections[p]
        mm, att, el = s.rates["matmul"], s.rates["attention"], s.rates["elementwise"]
        ar = s.collective("all_reduce", p, 1 << 20) * 1e3 if p > 1 else 0.0
        tp = max((b.group for b in s.tp_blocks), default=0)  # the wait of the largest TP group timed
        wait = HostCosts(profile, p).tp_wait(tp, False, 1 << 20) if tp else 0.0
        # shared: as the planner reads it (the speed alone over the kind's median slow-down, ``Rate.slowdown``)
        t.add_row(str(p), str(s.threads), f"{mm.alone[-1] / 1e9:.1f}", f"{mm.at(mm.sizes[-1], True) / 1e9:.1f}",
                  f"{att.alone[-1] / 1e9:.1f}", f"{el.alone[-1] / 1e9:.1f}", f"{s.op_overhead_s * 1e6:.1f}",
                  f"{ar:.2f}" if p > 1 else "-", f"{wait * 1e3:.2f} (tp{tp})" if tp else "-")
    console.print(t)
    if profile.calibrations > 1:
        console.print(f"the mean of {profile.calibrations} calibrations (every figure's time averaged)")
    moved = profile.host.get("speed_moved")
    if moved is not None:
        speed = float(profile.host.get("speed_flops", 0.0))
        over = f" over the {profile.calibrations} calibrations" if profile.calibrations > 1 else ""
        console.print(f"host speed during calibration: {speed / 1e9:.1f} GFLOP/s on average (one thread, "
                      f"{'x'.join(map(str, REFERENCE_SHAPE))} linear layer); it moved {float(moved):.0%} "
                      f"between phases{over}, and every phase's figures are scaled to the average")
        if float(moved) > STEADY:
            console.print(f"[yellow]warning: the host's speed moved more than {STEADY:.0%} while it was "
                          "measured (other jobs, or a virtual machine's neighbours): predictions made with "
                          "this profile follow the average, runs follow the moment; average calibrations taken "
                          "at several moments (`--add`, `--repeat`), or calibrate again when it "
                          "is steadier[/yellow]")


def register(app: typer.Typer) -> None:
    app.command("calibrate", help=HELP,
                short_help="Measure this host: the profile plan and train read.")(calibrate_command)
