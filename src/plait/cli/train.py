"""``plait train``: train a Llama under a TP x PP x DP layout on self-launched CPU processes or under torchrun."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

HELP = """Train a Llama with tensor, pipeline and data parallelism.

{defaults}

{config}

\b
Examples:
  plait train
  plait train --tp 1 --pp 4 --steps 100
  plait train --data my_texts/ --model small --metrics run.jsonl
  plait train --resume          # continue the latest checkpoint exactly
  torchrun --nproc-per-node 4 -m plait.cli.main train --tp 2 --pp 2
""".format(
    defaults="With no arguments: a tiny byte-level Llama on the Python standard library's own source files, "
             "tp 2 x pp 2 (1F1B) on 4 CPU processes launched here with PyTorch's elastic launcher. Under torchrun "
             "(also many nodes) each process runs as one worker instead.",
    config="Settings may also come from --config FILE.toml whose keys are the flag names (seq-len = 128); flags "
           "given on the command line win.")

Opt = typer.Option
_STARTED = time.time()  # when the CLI module was imported: the start of the command


def register(app: typer.Typer) -> None:
    app.command("train", help=HELP, no_args_is_help=False)(train_command)


def train_command(
    ctx: typer.Context,
    tp: Annotated[int, Opt(help="Tensor-parallel size (ranks that split each layer).")] = 2,
    pp: Annotated[int, Opt(help="Pipeline-parallel size (stages).")] = 2,
    dp: Annotated[int, Opt(help="Data-parallel size (model replicas).")] = 1,
    schedule: Annotated[str, Opt(help="Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb-h1, zbv, "
                                      "dualpipev.")] = "1f1b",
    microbatches: Annotated[int, Opt(help="Micro-batches per step (pipeline depth).")] = 4,
    virtual_stages: Annotated[int, Opt(help="Chunks per pipeline rank (interleaved schedules).")] = 1,
    sequence_parallel: Annotated[bool, Opt(help="Shard norms/residuals along the sequence between TP "
                                                "regions.")] = False,
    model: Annotated[str, Opt(help="tiny, small, or a Hugging Face Llama folder.")] = "tiny",
    data: Annotated[list[str] | None, Opt(help="Text files or folders (repeatable); default: the Python "
                                               "standard library's sources.")] = None,
    seq_len: Annotated[int, Opt(help="Tokens per sequence.")] = 128,
    batch_size: Annotated[int, Opt(help="Global batch size in sequences.")] = 16,
    steps: Annotated[int, Opt(help="Optimizer steps in total (a resumed run continues up to it).")] = 300,
    lr: Annotated[float, Opt(help="Peak learning rate (AdamW).")] = 3e-3,
    warmup: Annotated[int, Opt(help="Linear warm-up steps before cosine decay.")] = 20,
    clip: Annotated[float, Opt(help="Max global gradient norm (0: no clipping).")] = 1.0,
    weight_decay: Annotated[float, Opt(help="AdamW weight decay of matrices.")] = 0.0,
    precision: Annotated[str, Opt(help="fp32 or bf16 (bf16 compute over fp32 master weights).")] = "fp32",
    zero: Annotated[int, Opt(help="1: shard fp32 masters and optimizer state over data-parallel ranks (ZeRO-1); "
                                  "2: gradients too (ZeRO-2).")] = 0,
    experts: Annotated[int, Opt(help="Experts per feed-forward layer (1: dense; > 1: mixture of experts).")] = 1,
    top_k: Annotated[int, Opt(help="Experts each token is routed to (mixture of experts).")] = 1,
    ep: Annotated[int, Opt(help="Expert-parallel size: experts spread over ep ranks of the dp x tp plane.")] = 1,
    expert_tp: Annotated[bool, Opt(help="Split each expert over the TP group (ep must then divide dp).")] = False,
    seed: Annotated[int, Opt(help="Seed of weights, data order and sampling.")] = 0,
    checkpoint_dir: Annotated[str, Opt(help="Where checkpoints go (one folder per step, 'latest' "
                                            "points at the newest).")] = "plait-checkpoints",
    checkpoint_every: Annotated[int, Opt(help="Save every N steps (0: only at the end).")] = 0,
    resume: Annotated[bool, Opt(help="Continue from the latest checkpoint in --checkpoint-dir.")] = False,
    metrics: Annotated[str | None, Opt(help="Append one JSON line per step (step, loss, tokens_per_s, ...) "
                                            "to this file.")] = None,
    nproc: Annotated[int | None, Opt(help="Processes to launch here (default tp x pp x dp).")] = None,
    on_nonfinite: Annotated[str, Opt(help="On a NaN/inf loss: stop (default) or skip the step.")] = "stop",
    eval_every: Annotated[int, Opt(help="Held-out loss every N steps (0: only at the end).")] = 50,
    sample_tokens: Annotated[int, Opt(help="Length of the sample generated at the end (0: none).")] = 160,
    max_data_mb: Annotated[float, Opt(help="Read at most this many MB of text.")] = 4.0,
    trace_every: Annotated[int, Opt(help="Trace every N-th step to measure the bubble (0: never).")] = 10,
    config: Annotated[Path | None, Opt(help="TOML file whose keys are these flags' names.")] = None,
) -> None:
    from plait.errors import ConfigError

    try:
        cfg = _resolve(ctx, config)
        _run(cfg)
    except ConfigError as exc:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fails the same way: say it once
            typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _resolve(ctx: typer.Context, config: Path | None):
    """Defaults < TOML file < flags given on the command line."""
    from click.core import ParameterSource

    from plait.train.config import TrainConfig, field_names, read_toml

    values = read_toml(config) if config is not None else {}
    for name in field_names():
        if name in ctx.params and (ctx.get_parameter_source(name) != ParameterSource.DEFAULT or name not in values):
            values[name] = ctx.params[name]
    values["data"] = list(values.get("data") or [])
    return TrainConfig.from_dict(values)


def _run(cfg) -> None:
    from plait.train import train_job, validate
    from plait.train.launch import JobError, launch, under_torchrun

    if under_torchrun():
        train_job(cfg.to_dict())
        return
    validate(cfg)
    os.environ["PLAIT_LAUNCHED_AT"] = str(_STARTED)  # workers report start-up from here
    try:
        launch("plait.train:train_job", cfg.to_dict(), cfg.nproc or cfg.world)
    except JobError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(exc.exit_code) from None
    sys.stdout.flush()
