"""``plait topo``: read the GPU topology (`nvidia-smi topo -m`) and say which serving layout suits its links."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from plait.cli.plan import fail, planner_model
from plait.cli.plan_inference import inference_verdict

TOPO_HELP = """Read `nvidia-smi topo -m` (or --file), say which GPUs are joined how, and which serving layout
`plait plan --inference` recommends on these links (each TP size costed on the link its group uses).
Exit code 1 when there is no topology to read (no nvidia-smi, or it fails), 2 on a bad option or file.

\b
Examples:
  plait topo        # on a host with NVIDIA GPUs: reads nvidia-smi itself
  # elsewhere: save a GPU host's topology there, then read it here
  nvidia-smi topo -m > saved.txt
  plait topo --file saved.txt --model llama3-70b
  plait topo --file saved.txt --model llama3-70b --gpu l40s --batch 8 \\
      --weights int4
"""


@dataclass(frozen=True)
class TopoOptions:
    """The options of ``plait topo`` (one per field, its help the field's docstring)."""

    file: Path | None = None
    """a saved `nvidia-smi topo -m` output to read"""
    model: str = "llama3-8b"
    """the model to serve, for the advice"""
    gpu: str | None = None
    """GPU type (default: h100-sxm with NVLink, else h100-pcie)"""
    batch: int = 1
    """concurrent sequences"""
    prompt_len: int = 1024
    """prompt tokens"""
    gen_len: int = 256
    """generated tokens"""
    weights: str = "bf16"
    """bf16, fp16, fp8, int8 or int4"""


def topo(options: dict[str, Any]) -> None:
    """``plait topo`` (TOPO_HELP)."""
    from plait.errors import ConfigError, flag_message
    from plait.plan import Workload
    from plait.plan.topo import advice, parse_topo, read_topo, serving_advice, tp_groups

    o = TopoOptions(**options)
    if o.file is not None and not o.file.is_file():
        fail(f"--file {o.file}: no such file (save one with `nvidia-smi topo -m > {o.file}`)")
    try:
        text = o.file.read_text() if o.file is not None else read_topo()
    except UnicodeDecodeError:
        fail(f"--file {o.file}: not text, so not the output of `nvidia-smi topo -m`")
    if text is None:  # asked for a topology and none read: exit code 1, saying why
        why = (f"`{found} topo -m` failed (no driver loaded, or no GPU)" if (found := shutil.which("nvidia-smi"))
               else "nvidia-smi is not on PATH (no NVIDIA driver here)")
        fail(f"{why}: no GPU topology read. Pass --file with a saved `nvidia-smi topo -m` output.", code=1)
    try:
        t = parse_topo(text)
    except ValueError as exc:  # says what the text lacks: name where it came from
        fail(f"--file {o.file}: {exc}" if o.file is not None else f"nvidia-smi topo -m: {exc}")
    try:
        gpu = o.gpu or ("h100-sxm" if len(tp_groups(t)[0]) > 1 else "h100-pcie")
        work = Workload(o.batch, o.prompt_len, o.gen_len)
        res = serving_advice(t, planner_model(o.model, None), gpu, work, o.weights)
    except (ValueError, ConfigError) as exc:
        fail(flag_message(exc))
    source = f"--file {o.file}" if o.file is not None else "`nvidia-smi topo -m`"
    typer.echo(f"{len(t.gpus)} GPUs, read from {source}")
    for line in advice(t):
        typer.echo("• " + line)
    typer.echo(f"serving {o.model} on them ({gpu}, batch {o.batch}, prompt {o.prompt_len}, {o.gen_len} new tokens, "
               f"{o.weights} weights), as `plait plan --inference` ranks it:")
    for line in inference_verdict(res):
        typer.echo("• " + line.strip())


def register(app: typer.Typer) -> None:
    from plait.cli.options import dataclass_options, with_options

    command = app.command("topo", help=TOPO_HELP,
                          short_help="Read a GPU host's links; rank serving layouts on it.")
    command(with_options(dataclass_options(TopoOptions), "options")(topo))
