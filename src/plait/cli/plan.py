"""``plait plan`` and ``plait topo``: choose a layout before booking hardware, and read the GPU topology."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

GB = 1e9
PLAN_HELP = """Find the fastest parallel layout that fits, for training (default) or inference.

Searches tensor (TP), pipeline (PP), data (DP) and context parallelism, micro-batch size, pipeline
schedule, recomputation and ZeRO stage; prints the best layouts with their memory on the most loaded
GPU, step time, MFU and why the best wins. Models: docs/planner.md.

\b
Examples:
  plait plan --model llama3-70b --gpus 64 --gpu h100-sxm --gpus-per-node 8
  plait plan --model llama3-405b --gpus 16384 --gpu h100-sxm --global-batch 2048 --show-schedule
  plait plan --model path/to/config.json --gpus 8 --gpu a100-80gb --seq-len 4096
  plait plan --model llama3-70b --gpus 4 --gpu a100-80gb --inference --batch 8 --prompt-len 2048
"""


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _model(name: str, seq_len: int | None):
    from plait.plan import Model

    if name.endswith(".json") or Path(name).is_dir():
        return Model.from_hf_config(name, seq_len=seq_len)
    return Model.preset(name, seq_len=seq_len)


def _training_table(result, title: str):
    from rich.table import Table

    t = Table(title=title, header_style="bold")
    for col in ("#", "layout", "step s", "MFU", "TF/s/GPU", "bubble", "memory GB: weights+grads+optim+activ"):
        t.add_column(col, justify="left" if col in ("layout", "#") else "right", no_wrap=True)
    for i, e in enumerate(result.best, 1):
        m = e.memory
        parts = "+".join(f"{x / GB:.1f}" for x in (m.weights, m.grads, m.optimizer, m.activations))
        label = e.layout.short() + (" padded-rounds" if e.rounds == "padded" else "")
        t.add_row(str(i), label, f"{e.step_time_s:.2f}", f"{e.mfu:.1%}", f"{e.tflops_per_gpu:.0f}",
                  f"{e.bubble_fraction:.1%}", f"{parts} = {m.total / GB:.1f} of {m.usable / GB:.0f}")
    return t


def _breakdown_table(best):
    from rich.table import Table

    t = Table(title="time of the best layout's step", header_style="bold")
    t.add_column("part")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    for k, v in best.time.items():
        t.add_row(k, f"{v:.3f}", f"{v / best.step_time_s:.1%}")
    return t


def _show_schedule(console, best) -> None:
    from plait.plan.timing import stage_costs
    from plait.schedules import build_schedule
    from plait.sim import Costs, simulate

    lay = best.layout
    if lay.pp == 1:
        console.print("(no pipeline: pp = 1, micro-batches run one after another)")
        return
    m = min(best.microbatches, 4 * lay.pp)
    c = stage_costs(best.model, best.cluster, lay)
    weight = c.weight if lay.schedule in ("zb-h1", "zbv", "dualpipev") else None
    r = simulate(build_schedule(lay.schedule, stages=lay.pp, microbatches=m, virtual=lay.virtual,
                                rounds=best.rounds),
                 Costs(forward=c.forward, backward=c.backward, weight=weight, p2p=c.p2p))
    shown = f"first {m} of {best.microbatches}" if m < best.microbatches else f"all {m}"
    console.print(f"[bold]{lay.schedule}[/], pp={lay.pp}, v={lay.virtual}, {shown} micro-batches "
                  f"(times in s; bubble {r.bubble_fraction:.1%}):")
    console.print(r.to_ascii(width=100))


def _inference(console, model, cluster, batch: int, prompt: int, gen: int, as_json: bool) -> None:
    from rich.table import Table

    from plait.plan import Workload, plan_inference

    res = plan_inference(model, cluster, Workload(batch, prompt, gen))
    if as_json:
        typer.echo(json.dumps({"best": res.best.to_dict() if res.best else None,
                               "options": [o.to_dict() for o in res.options]}, indent=1))
        return
    t = Table(title=f"{model.name} inference on {cluster.n_gpus} × {cluster.gpu.name}: batch {batch}, "
                    f"prompt {prompt}, {gen} new tokens", header_style="bold")
    for col in ("layout", "fits", "weights GB", "KV GB", "total GB", "max batch", "max ctx", "ms/token",
                "TTFT ms", "tok/s", "warning"):
        t.add_column(col, justify="left" if col in ("layout", "warning") else "right")
    for o in res.options:
        t.add_row(o.label, "yes" if o.fits else "no", f"{o.weights_gb:.1f}", f"{o.kv_cache_gb:.1f}",
                  f"{o.total_gb:.1f}", str(o.max_batch), f"{o.max_context:,}", f"{o.token_latency_ms:.1f}",
                  f"{o.ttft_ms:.0f}", f"{o.throughput_tok_s:,.0f}", "; ".join(o.warnings))
    console.print(t)
    if res.best is None:
        _fail(f"{model.name} fits no serving layout on {cluster.n_gpus} × {cluster.gpu.name}; "
              f"it needs {2 * model.n_params() / GB:.0f} GB for bf16 weights alone", 1)
    b = res.best
    console.print(f"best: {b.label} — {b.token_latency_ms:.1f} ms/token "
                  f"(memory {b.breakdown_ms['memory']:.1f}, TP all-reduce {b.breakdown_ms['tp_comm']:.1f}, "
                  f"p2p {b.breakdown_ms['p2p']:.1f} ms), {b.throughput_tok_s:,.0f} tok/s")


def _write_config(path: Path, best, model_arg: str) -> None:
    """Write ``best``'s layout (and batch, sequence length, model when plait train can build it) as TOML."""
    from plait.errors import ConfigError
    from plait.train.config import PRESETS, toml_text

    if not best.layout.runnable:
        raise ConfigError(f"--write-config: the best layout {best.layout.short()} is plan-only; drop --plan-only")
    folder = Path(model_arg).parent if model_arg.endswith(".json") else Path(model_arg)
    trainable = model_arg in PRESETS or (folder / "config.json").is_file()
    values = {"model": (model_arg if model_arg in PRESETS else str(folder)) if trainable else None,
              **best.layout.to_parallel_config(best.training).to_dict(),
              "batch_size": best.training.global_batch, "seq_len": best.model.seq_len}
    header = (f"plait plan's best layout for {best.model.name}: {best.layout.short()} "
              f"({best.step_time_s:.3g} s/step predicted on {best.cluster.n_gpus} x {best.cluster.gpu.name})")
    if not trainable:
        header += f"\n{model_arg} is a planner preset: give plait train --model a Hugging Face folder of it"
    path.write_text(toml_text(values, header))


def plan(
    model: Annotated[str, typer.Option(help="preset (llama3-8b, llama3-70b, llama3-405b, gpt3-175b, "
                                             "mixtral-8x7b) or a Hugging Face config.json")],
    gpus: Annotated[int, typer.Option(help="number of GPUs")],
    gpu: Annotated[str, typer.Option(help="GPU type, e.g. h100-sxm, a100-80gb")] = "h100-sxm",
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node (TP stays inside)")] = 8,
    interconnect: Annotated[str | None, typer.Option(help="inter-node fabric, e.g. ib-ndr")] = None,
    seq_len: Annotated[int | None, typer.Option(help="sequence length (default: the model's)")] = None,
    global_batch: Annotated[int | None, typer.Option(help="sequences per step (default ~4M tokens)")] = None,
    top: Annotated[int, typer.Option(help="how many layouts to show")] = 5,
    inference: Annotated[bool, typer.Option("--inference", help="plan serving instead")] = False,
    batch: Annotated[int, typer.Option(help="inference: concurrent sequences")] = 1,
    prompt_len: Annotated[int, typer.Option(help="inference: prompt tokens")] = 1024,
    gen_len: Annotated[int, typer.Option(help="inference: generated tokens")] = 256,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of tables")] = False,
    show_schedule: Annotated[bool, typer.Option("--show-schedule", help="Gantt of the best")] = False,
    max_memory_fraction: Annotated[float, typer.Option(help="share of each device's memory a layout may use")] = 0.9,
    plan_only: Annotated[bool, typer.Option("--plan-only", help="also consider what only the planner models "
                                            "(context parallelism, ZeRO-3), marked plan-only")] = False,
    write_config: Annotated[Path | None, typer.Option(help="write the best layout as a `plait train --config` "
                                                      "TOML file")] = None,
) -> None:
    from rich.console import Console

    from plait.errors import ConfigError
    from plait.plan import Cluster, Training, explain, search
    from plait.plan.explain import nothing_fits

    console = Console(width=None if sys.stdout.isatty() else 140)
    try:
        m = _model(model, seq_len)
        cluster = Cluster(gpu, gpus, gpus_per_node, interconnect, max_memory_fraction=max_memory_fraction)
        if inference:
            _inference(console, m, cluster, batch, prompt_len, gen_len, as_json)
            return
        training = Training(global_batch or max(1, 4_194_304 // m.seq_len))
        result = search(m, cluster, training, top=top, plan_only=plan_only)
        if result.best and write_config is not None:
            _write_config(write_config, result.best[0], model)
    except ConfigError as exc:
        _fail(str(exc))
    if not result.best:
        _fail(f"{m.name} on {gpus} × {cluster.gpu.name}: " + nothing_fits(result, m, cluster.usable_memory), 1)
    if as_json:
        out: dict[str, Any] = {"best": [e.to_dict() for e in result.best],
                               "rejected": dict(result.rejected), "pruned": result.pruned,
                               "considered": result.considered, "why": explain(result),
                               "max_memory_fraction": max_memory_fraction}
        typer.echo(json.dumps(out, indent=1))
        return
    title = (f"{m.name} ({m.n_params() / 1e9:.1f}B, seq {m.seq_len}) on {gpus} × {cluster.gpu.name}, "
             f"{cluster.gpus_per_node}/node; global batch {training.global_batch}")
    console.print(_training_table(result, title))
    console.print(_breakdown_table(result.best[0]))
    for line in explain(result):
        console.print("• " + line)
    if show_schedule:
        _show_schedule(console, result.best[0])


def topo(
    file: Annotated[Path | None, typer.Option(help="a saved `nvidia-smi topo -m` output to read")] = None,
) -> None:
    """Read `nvidia-smi topo -m` (or --file) and say which GPUs suit tensor parallelism."""
    from plait.plan.topo import advice, parse_topo, read_topo

    text = file.read_text() if file is not None else read_topo()
    if text is None:
        typer.echo("nvidia-smi not found (no NVIDIA GPU here): nothing to read. "
                   "Pass --file with a saved `nvidia-smi topo -m` output.")
        raise typer.Exit(0)
    try:
        t = parse_topo(text)
    except ValueError as exc:
        _fail(str(exc))
    typer.echo(f"{len(t.gpus)} GPUs")
    for line in advice(t):
        typer.echo("• " + line)


def register(app: typer.Typer) -> None:
    app.command("plan", help=PLAN_HELP)(plan)
    app.command("topo")(topo)
