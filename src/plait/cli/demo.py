"""``plait demo``: a short tour on local CPU processes — simulate schedules, then prove a 3D layout exact."""

from __future__ import annotations

import typer
from rich.console import Console

HELP = """A two-minute tour that needs no download: compares pipeline schedules in the simulator, then
runs a small Llama with tensor x pipeline parallelism on 4 CPU processes and checks every gradient
against a single-device run. `plait train` is the real training command.

\b
Examples:
  plait demo
  plait demo && plait train --steps 50  # then a first small training run
"""


def demo_command() -> None:
    from plait.cli.verify import result_table, verdict_text
    from plait.parallel_config import ParallelConfig
    from plait.schedules import build_schedule
    from plait.sim import Costs, simulate
    from plait.verify import VerifyConfig, verify

    console = Console()
    console.rule("1. Schedules as data: 4 stages, 8 micro-batches, F=1 B=2 (I=W=1)")
    for name in ("1f1b", "zbv"):
        sim = simulate(build_schedule(name, stages=4, microbatches=8), Costs(1.0, 2.0, 1.0))
        console.print(sim.to_ascii(min(96, console.width - 12)), markup=False, highlight=False)
        console.print(f"bubble {sim.bubble_fraction:.1%}, peak activations {sim.peak_activations}\n")
    for schedule in ("1f1b", "zbv"):
        console.rule(f"2. tp=2 x pp=2 on 4 CPU processes, {schedule}: parallel vs one device")
        layout = ParallelConfig(tp=2, pp=2, dp=1, schedule=schedule, microbatches=8, sequence_parallel=True)
        cfg = VerifyConfig(layout)
        result = verify(cfg)
        table = result_table(result)
        console.print(table)
        console.print(f"loss parallel {result.loss_parallel:.7f} vs single {result.loss_single:.7f} "
                      f"(rel {result.loss_rel:.1e}); peak activations measured {result.peak_measured}, "
                      f"simulated {result.peak_simulated}")
        console.print(verdict_text(result))
        if not result.ok:
            raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("demo", help=HELP, short_help="A two-minute tour, no download: start here.")(demo_command)
