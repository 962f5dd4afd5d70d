"""``plait simulate``: draw and time a pipeline schedule, or compare several side by side."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from plait.cli.plan import fail

HELP = """Simulate a pipeline-parallel schedule and draw it as a Gantt chart.

A batch is cut into MICROBATCHES micro-batches that flow through STAGES pipeline ranks. Each rank runs
its list of steps in order: F (forward), B (backward), or a backward split into I (input gradient,
needed by the previous stage) and W (weight gradient, which can wait). A step starts when its rank is
free and its input has arrived (+P2P from another rank). Idle time is the "bubble".

\b
Schedules (--schedule):
  gpipe             all forwards then all backwards; holds all M micro-batches
                    (naive when M=1)
  1f1b              warm-up, then one-forward-one-backward; holds at most P
                    micro-batches
  interleaved-1f1b  V chunks per rank (chunk c on rank c % P); bubble shrinks
                    ~V times
  looped-bfs        V chunks per rank, each chunk runs every micro-batch
                    before the next
  zb-h1             1F1B with split backward; W fills the bubble (~1/3 of
                    1F1B's when F=I=W); with V > 1 chunks per rank: ZB1P,
                    interleaved like interleaved-1f1b
  zbv               zero-bubble V: 2 chunks per rank (chunk c on rank c, or
                    2P-1-c)
  dualpipev         DeepSeek's DualPipeV, V-shaped; forward/backward pairs
                    (needs M >= 2P)

Costs are per micro-batch through one whole stage (a chunk costs 1/V of it); a split backward
costs I = backward - weight and W = weight (default: backward/2).

Peak activations: micro-batches held at once (a chunk counts 1/V), from the start of F until
the end of B, or of W for a split backward.

\b
Examples:
  plait simulate --schedule 1f1b --stages 4 --microbatches 8
  plait simulate -s interleaved-1f1b -p 4 -m 8 --virtual-stages 3 --p2p 0.1
  # M % P != 0: fewer held:
  plait simulate -s interleaved-1f1b -p 4 -m 10 --rounds padded
  plait simulate -p 8 -m 32 \\
      --compare gpipe,1f1b,interleaved-1f1b,zb-h1,zbv,dualpipev
  plait simulate -s zbv -p 4 -m 8 --png zbv.png --trace zbv.json --csv zbv.csv
  # a torch.distributed.pipelining CSV:
  plait simulate --from-csv my_schedule.csv
"""


def _build(name: str, stages: int, microbatches: int, virtual: int | None, from_csv: Path | None,
           rounds: str | None = None):
    from plait.schedules import Schedule, build_schedule

    if from_csv is not None:
        return Schedule.from_csv(from_csv, name=from_csv.stem)
    return build_schedule(name, stages=stages, microbatches=microbatches, virtual=virtual,
                          rounds=rounds).validate()


def _num(x: float) -> str:
    """A time or a count of micro-batches as a reader takes it in: 4 significant digits (4.333, 0.3833), and
    no exponent from 10,000 up (17,250)."""
    return f"{x:,.0f}" if abs(x) >= 1e4 else f"{x:.4g}"


def _figures_table(result) -> object:
    from rich.table import Table

    table = Table(title="per rank", title_justify="left")
    for col in ("rank", "chunks", "busy", "idle", "idle %", "peak activations"):
        table.add_column(col, justify="right")
    s = result.schedule
    for r in range(s.num_ranks):
        idle = result.idle[r]
        table.add_row(str(r), ",".join(map(str, s.stages_of_rank(r))), _num(result.busy[r]), _num(idle),
                      f"{idle / result.makespan:.1%}" if result.makespan else "-", _num(result.peak_activations[r]))
    return table


def _compare(names: str, stages: int, microbatches: int, virtual: int | None, costs, as_json: bool,
             rounds: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from plait.errors import ConfigError, flag_message
    from plait.schedules import build_schedule
    from plait.schedules.build import ROUND_SCHEDULES
    from plait.sim import simulate
    from plait.words import counted

    table = Table(title=f"P={counted(stages, 'stage')}, M={counted(microbatches, 'micro-batch')}, costs "
                        f"F={costs.forward} B={costs.backward} W={costs.weight if costs.weight is not None else 'B/2'} "
                        f"p2p={costs.p2p}")
    table.add_column("schedule", no_wrap=True)
    for col in ("V", "makespan", "bubble", "idle/rank", "peak act. rank 0", "peak act. max"):
        table.add_column(col, justify="right")
    rows: list[dict] = []
    split = False  # whether a listed schedule splits its backward (reads --weight)
    listed = [n.strip() for n in names.split(",") if n.strip()]
    if not listed:
        raise ConfigError(f"--compare {names!r}: names no schedule; list some, e.g. --compare gpipe,1f1b,zbv (valid "
                          f"names are {', '.join(_names())})")
    twice = sorted({n.lower() for n in listed if [m.lower() for m in listed].count(n.lower()) > 1})
    if twice:
        raise ConfigError(f"--compare {names}: {', '.join(twice)} listed more than once; list each schedule once "
                          "(its row would repeat)")
    for name in listed:
        if name.lower() not in _names():
            raise ConfigError(f"--compare {names}: unknown schedule {name!r}; valid names are {', '.join(_names())}")
        multi = name in ("interleaved-1f1b", "looped-bfs", "zb-h1")
        try:
            sched = build_schedule(name, stages=stages, microbatches=microbatches,
                                   virtual=virtual if multi else None,
                                   rounds=rounds if name in ROUND_SCHEDULES else None)
            r = simulate(sched, costs)
        except ConfigError as exc:
            why = flag_message(exc).splitlines()[0]
            table.add_row(name, "-", "-", "-", "-", "-", f"n/a: {why}")
            rows.append({"schedule": name, "error": why})
            continue
        split = split or _splits_backward(sched)
        rows.append(r.to_dict())
        table.add_row(name, str(sched.virtual), _num(r.makespan), f"{r.bubble_fraction:.1%}",
                      _num(sum(r.idle) / len(r.idle)), _num(r.peak_activations[0]), _num(max(r.peak_activations)))
    if costs.weight is not None and not split:
        raise ConfigError(f"--weight {costs.weight:g}: none of --compare {names} splits its backward into I and W, "
                          "so no weight-gradient part is timed; add zb-h1, zbv or dualpipev, or leave --weight out")
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
    else:
        Console().print(table)


def _splits_backward(schedule) -> bool:
    """Whether ``schedule`` runs split backwards (I and W actions), whose W part --weight times."""
    return any(a.kind == "W" for actions in schedule.actions for a in actions)


def _names() -> tuple[str, ...]:
    from plait.schedules import SCHEDULE_NAMES

    return SCHEDULE_NAMES


def _outputs(result, png: Path | None, trace: Path | None, csv_out: Path | None) -> list[str]:
    """Write the files asked for (their folders made); ConfigError naming the flag of one that cannot be."""
    from plait.errors import ConfigError

    writers = (("--csv", csv_out, lambda p: result.schedule.to_csv(p), "PyTorch pipelining CSV {}"),
               ("--trace", trace, lambda p: p.write_text(json.dumps(result.to_chrome_trace())),
                "Chrome/Perfetto trace {} (open in ui.perfetto.dev)"),
               ("--png", png, result.to_png, "{}"))
    notes = []
    for flag, path, write, what in writers:
        if path is None:
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write(path)
        except OSError as exc:
            raise ConfigError(f"{flag} {path}: cannot write it ({exc.strerror or exc})") from None
        notes.append("wrote " + what.format(path))
    return notes


@dataclass(frozen=True)
class SimulateOptions:
    """The options of ``plait simulate`` (one per field, its help the field's docstring)."""

    schedule: str = "1f1b"
    """One of: gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zbv, dualpipev."""
    stages: int = 4
    """Pipeline ranks P."""
    microbatches: int = 8
    """Micro-batches M that one batch (a training step) is cut into, each flowing through every stage."""
    virtual_stages: int | None = None
    """Chunks per pipeline rank V (default 1; 2 for interleaved-1f1b, looped-bfs, zbv, dualpipev)."""
    forward: float = 1.0
    """Forward time of one micro-batch through a whole stage."""
    backward: float = 2.0
    """Full backward time (I + W) per micro-batch and stage."""
    weight: float | None = None
    """Weight-gradient part W of a split backward (zb-h1, zbv, dualpipev; default backward/2)."""
    p2p: float = 0.0
    """Latency added to a dependency from another rank."""
    rounds: str | None = None
    """interleaved-1f1b / zb-h1 with M % P != 0: 'equal' rounds (default; bubble (P-1)/(VM+P-1)) or 'padded'
    rounds of P (fewer micro-batches held)."""
    compare: str | None = None
    """Comma-separated schedules to compare in one table, e.g. gpipe,1f1b,zb-h1,zbv."""
    png: Path | None = None
    """Save the timeline as a PNG (matplotlib)."""
    trace: Path | None = None
    """Save a Chrome/Perfetto trace JSON."""
    csv: Path | None = None
    """Export the schedule as PyTorch pipelining's compute-only CSV."""
    from_csv: Path | None = None
    """Simulate a schedule read from a PyTorch pipelining CSV instead of --schedule/--stages/--microbatches."""
    as_json: bool = False
    """Print the figures as JSON only (a list with --compare)."""
    actions: bool = False
    """Also print each rank's action list."""
    width: int | None = None
    """Columns for the chart's time axis (default: the terminal's width)."""


#: option names other than the field's: the short forms (-s, -p, -m, -v) and --json
FLAGS: dict[str, str | tuple[str, ...]] = {
    "schedule": ("--schedule", "-s"), "stages": ("--stages", "-p"), "microbatches": ("--microbatches", "-m"),
    "virtual_stages": ("--virtual-stages", "-v"), "as_json": "--json"}


def _check_unread(o: SimulateOptions, virtual_alias: int | None) -> None:
    """ConfigError naming options the chosen mode would not read: --compare simulates the schedules it lists and
    draws no chart (so writes no --png, --trace or --csv, prints no --actions), --from-csv reads its schedule
    from the file; and --width counts columns."""
    from plait.cli.options import set_away
    from plait.errors import ConfigError

    if o.width is not None and o.width < 1:
        raise ConfigError(f"--width {o.width}: must be >= 1 column (or left out: the terminal's width)")
    if o.compare is not None and (said := set_away(o, ("schedule", "png", "trace", "csv", "actions", "width",
                                                       "from_csv"))):
        raise ConfigError(f"{said}: not with --compare, which simulates the schedules it lists and prints one table "
                          "of figures, no chart; simulate one schedule for these")
    if o.as_json and (said := set_away(o, ("actions", "width"))):
        raise ConfigError(f"{said}: not with --json, which prints the figures only (no chart, no action lists)")
    said = set_away(o, ("schedule", "stages", "microbatches", "virtual_stages", "rounds"))
    if o.from_csv is not None and (said or virtual_alias is not None):
        raise ConfigError(f"{said or '--virtual'}: not with --from-csv, whose file sets the schedule, its ranks, "
                          "chunks and micro-batches")


def simulate_command(
    options: dict[str, Any],
    virtual_alias: Annotated[int | None, typer.Option("--virtual", hidden=True,
                                                      help="Old name of --virtual-stages.")] = None,
) -> None:
    from rich.console import Console
    from rich.text import Text

    from plait.errors import ConfigError, check_output_path, flag_message
    from plait.sim import Costs, simulate
    from plait.words import counted

    o = SimulateOptions(**options)
    try:
        _check_unread(o, virtual_alias)
        if o.from_csv is not None and not o.from_csv.is_file():
            raise ConfigError(f"--from-csv {o.from_csv}: no such file")
        for flag, path in (("--png", o.png), ("--trace", o.trace), ("--csv", o.csv)):
            check_output_path(flag, None if path is None else str(path), folder=False)
    except ConfigError as exc:
        fail(flag_message(exc))
    costs = Costs(forward=o.forward, backward=o.backward, weight=o.weight, p2p=o.p2p)
    virtual = o.virtual_stages if virtual_alias is None else virtual_alias
    try:
        if o.compare is not None:
            return _compare(o.compare, o.stages, o.microbatches, virtual, costs, o.as_json, o.rounds)
        schedule = _build(o.schedule, o.stages, o.microbatches, virtual, o.from_csv, o.rounds)
        if o.weight is not None and not _splits_backward(schedule):
            raise ConfigError(f"--weight {o.weight:g}: {schedule.name} runs each backward whole (B), with no "
                              "weight-gradient part W to time; only schedules that split it read --weight (zb-h1, "
                              "zbv, dualpipev)")
        result = simulate(schedule, costs)
        notes = _outputs(result, o.png, o.trace, o.csv)
    except (ConfigError, OSError) as exc:
        fail(flag_message(exc))
    if o.as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return None
    console = Console(highlight=False)
    console.soft_wrap = not console.is_terminal  # into a file or a pipe no line is folded at an assumed 80 columns
    cols = o.width or max(40, min(200, shutil.get_terminal_size((120, 24)).columns - 12))
    chart = result.to_rich(cols) if console.is_terminal and console.color_system else Text(result.to_ascii(cols))
    header, *rows = chart.split("\n")  # colours tell the kinds apart even in 1-column blocks
    console.print(header)
    for row in rows:  # a row is as wide as --width made it: never folded, which would cut 'rank 0 |' from its steps
        console.print(row, soft_wrap=True)
    if o.actions:
        console.print(result.schedule.grid(window=10**9), markup=False)
    console.print(_figures_table(result))
    console.print(f"makespan {_num(result.makespan)}   bubble {result.bubble_fraction:.1%} "
                  f"(mean idle share of device time)   peak activations max "
                  f"{counted(max(result.peak_activations), 'micro-batch', _num(max(result.peak_activations)))}")
    for note in notes:
        console.print(note)
    return None


def register(app: typer.Typer) -> None:
    """Add the ``simulate`` command to the ``plait`` app."""
    from plait.cli.options import dataclass_options, with_options

    command = with_options(dataclass_options(SimulateOptions, flags=FLAGS), "options")(simulate_command)
    app.command("simulate", help=HELP, short_help="Draw and time a pipeline schedule.",
                no_args_is_help=False)(command)
