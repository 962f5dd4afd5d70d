"""``plait train``: train a model under a TP x PP x DP layout on self-launched CPU processes or under torchrun."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

HELP = """Train a language model (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE) with tensor, pipeline, data and
expert parallelism.

{defaults}

{config}

\b
Examples:
  plait train
  plait train --tp 1 --pp 4 --steps 100
  plait train --data my_texts/ --model small --metrics run.jsonl
  plait data prepare corpus.jsonl --tokenizer bytes --out data/c && \\
      plait train --data data/c
  # a weighted mixture:
  plait train --data 0.7:data/web --data 0.3:data/code --tensorboard runs/a
  plait train --resume   # continue the latest checkpoint exactly
  plait train --layout auto --nproc 4   # the fastest layout of 4 processes
  # mixture of experts:
  plait train --tp 1 --pp 1 --dp 4 --experts 8 --top-k 2 --ep 4 \\
      --capacity-factor 1.25
  # a model folder's own experts:
  plait train --model ./my-mixtral --data data/c --tp 1 --pp 2 --dp 2 --ep 2
  # ZeRO-3: each pipeline stage's parameters sharded over dp:
  plait train --tp 1 --pp 2 --dp 2 --zero 3
  # the same with two chunks a rank (any schedule without a split backward):
  plait train --tp 1 --pp 2 --dp 2 --zero 3 --schedule interleaved-1f1b
  # what it would cost, nothing launched:
  plait train --tp 2 --pp 2 --dry-run --cluster host.toml
  # attention within each packed document:
  plait train --data data/c --document-mask --tp 1 --pp 1 --cp 2 --dp 2
  torchrun --nproc-per-node 4 -m plait.cli.main train --tp 2 --pp 2
  # each restart continues the latest checkpoint:
  torchrun --nproc-per-node 4 --max-restarts 3 -m plait.cli.main train \\
      --auto-resume
""".format(
    defaults="With no arguments: a tiny byte-level Llama on the Python standard library's own source files, "
             "tp 2 x pp 2 (1F1B) on 4 CPU processes launched here with PyTorch's elastic launcher. Under torchrun "
             "(also many nodes) each process runs as one worker instead.",
    config="Settings may also come from --config FILE.toml whose keys are the flag names (seq-len = 128); flags "
           "given on the command line win.")

Opt = typer.Option
TARGET = "plait.cli.train_worker:train_worker"  # the entry of each launched worker
_STARTED = time.time()  # when the CLI module was imported: the start of the command


def register(app: typer.Typer) -> None:
    from plait.cli.options import dataclass_options, with_options
    from plait.parallel_config import ParallelConfig
    from plait.train.config import TRAIN_PARALLEL, TrainConfig

    options = dataclass_options(ParallelConfig, TRAIN_PARALLEL) + dataclass_options(TrainConfig, TrainConfig())
    command = app.command("train", help=HELP, short_help="Train a model under a parallel layout.",
                          no_args_is_help=False)
    command(with_options(options, into="options")(train_command))


def train_command(
    ctx: typer.Context,
    config: Annotated[Path | None, Opt(help="TOML file whose keys are these flags' names.")] = None,
    options: dict | None = None,
) -> None:
    """The ``options`` are every ParallelConfig and TrainConfig field, generated (plait.cli.options)."""
    from plait.errors import ConfigError, flag_message

    try:
        cfg = _resolve(ctx, config, options or {})
        _run(cfg)
    except ConfigError as exc:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fails the same way: say it once
            typer.echo(f"error: {flag_message(exc)}", err=True)
        raise typer.Exit(2) from None


def _resolve(ctx: typer.Context, config: Path | None, options: dict):
    """Defaults < TOML file < flags given on the command line. ConfigError naming the layout options given with
    --layout auto, which chooses them all (but --precision): a given --tp would be silently replaced."""
    from plait.cli.options import check_cp_comm, typed
    from plait.errors import ConfigError
    from plait.parallel_config import field_names
    from plait.train.config import PRESETS, TrainConfig, read_toml

    values = read_toml(config) if config is not None else {}
    given = set(values) | {name for name in options if typed(ctx, name)}
    for name, value in options.items():
        if typed(ctx, name) or name not in values:
            values[name] = value
    values["data"] = list(values.get("data") or [])
    chosen = [f"--{n.replace('_', '-')}" for n in field_names() if n in given and n != "precision"]
    if values.get("layout") == "auto" and chosen:
        raise ConfigError(f"{', '.join(chosen)}: --layout auto chooses the whole layout (all but --precision); drop "
                          f"{'it' if len(chosen) == 1 else 'them'}, or keep {'it' if len(chosen) == 1 else 'them'} "
                          "with --layout flags")
    check_cp_comm(values.get("cp", 1), values.get("cp_comm", "allgather"))
    if "top_k" in given and values.get("model", "tiny") not in PRESETS:  # else silently the folder's own
        raise ConfigError(f"--top-k {values['top_k']}: it routes the experts --experts gives a preset "
                          f"({', '.join(PRESETS)}); --model {values['model']} routes as its config.json says "
                          "(num_experts_per_tok); leave --top-k out")
    if "max_data_mb" in given and values["data"] and all(_prepared(e) for e in values["data"]):
        raise ConfigError(f"--max-data-mb {values['max_data_mb']:g}: it limits the plain text tokenized at start-up, "
                          "but every --data is a prepared dataset (read whole, memory-mapped); leave it out")
    return TrainConfig.from_dict(values)


def _prepared(entry: str) -> bool:
    from plait.data import is_prepared
    from plait.data.stream import parse_entry

    return is_prepared(parse_entry(entry)[1])


def _run(cfg) -> None:
    from contextlib import nullcontext

    from plait.cli.predict import check_cluster, check_dry_run
    from plait.cli.progress import layout_words, starting
    from plait.cli.train_worker import PRELOAD
    from plait.distributed import fork_server
    from plait.distributed.job_signals import STOP_TIMEOUT_S
    from plait.distributed.launch import JobError, JobStopped, launch, under_torchrun
    from plait.train import validate
    from plait.train.config import check_nproc, check_outputs
    from plait.train.restart import check_resume, complete_message

    if under_torchrun():
        _torchrun_worker(cfg)
        return
    check_nproc(cfg)
    if not cfg.dry_run:  # a line at once: this process and the fork server import torch next (seconds)
        starting("train", cfg.nproc or cfg.world, "--layout auto" if cfg.layout == "auto" else
                 layout_words(cfg.parallel))
    # the workers' fork server imports torch and the training modules while this process checks the run (and
    # imports torch itself): side by side on two cores
    with nullcontext() if cfg.dry_run else fork_server.ahead(TARGET, PRELOAD):
        if cfg.layout == "auto":
            from plait.cli.auto_layout import auto_layout

            check_dry_run(cfg)  # before the search, which it would print and then refuse
            cfg, line = auto_layout(cfg, cfg.nproc or cfg.world)
            typer.echo(line)
        validate(cfg)
        resumed = check_resume(cfg)
        check_outputs(cfg)
        if not cfg.dry_run:  # another run saving into --checkpoint-dir: refused before any process starts
            from plait.checkpoint.lock import hold_folder  # plait.checkpoint imports torch: after the first line

            with hold_folder(cfg.checkpoint_dir):
                pass
        check_cluster(cfg, cfg.nproc or cfg.world)
    if resumed is not None and resumed[1] >= cfg.steps:  # nothing to train: said, nothing launched
        typer.echo(complete_message(cfg, *resumed))
        return
    if cfg.dry_run:
        _dry_run(cfg, resumed)
        return
    _say_loading(cfg, resumed)
    from plait.train.preempt import SIGNALS as STOP_SIGNALS

    os.environ["PLAIT_LAUNCHED_AT"] = str(_STARTED)  # workers report start-up from here
    try:
        launch(TARGET, cfg.to_dict(), cfg.nproc or cfg.world, STOP_SIGNALS, again_kills=True,
               preload=PRELOAD)  # Ctrl-C: a checkpoint at the next step; again: stop at once
    except JobStopped as exc:  # a stop signal before the workers could stop at a step's end with a checkpoint
        how = ("the workers were killed before saving (a second Ctrl-C, or no step's end within "
               f"{STOP_TIMEOUT_S:.0f} s)" if exc.killed else "before the first step: nothing trained, no checkpoint")
        typer.echo(f"plait train: stopped ({exc.signal_name}) {how}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except JobError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        if exc.exit_code == 1:  # not a refused setting (2) or a non-finite loss (3): a worker died or waited too long
            typer.echo(_after_failure(cfg), err=True)
        from plait.distributed.at_exit import skip_collection_at_exit

        skip_collection_at_exit()  # the job has ended: nothing left to do but exit
        raise typer.Exit(exc.exit_code) from None
    sys.stdout.flush()


def _after_failure(cfg) -> str:
    """What to do after a run that failed (a worker died, one waited too long on a peer): continue from the latest
    complete checkpoint of --checkpoint-dir, or start again where there is none."""
    from plait.checkpoint import CheckpointReader, find_checkpoint

    found = find_checkpoint(cfg.checkpoint_dir)
    if found is None:
        when = "" if cfg.checkpoint_every or cfg.checkpoint_every_minutes else \
            " (without --checkpoint-every it saves at its end only)"
        return f"plait train: no complete checkpoint in {cfg.checkpoint_dir}{when}; the same command starts again"
    again = "the same command" + ("" if cfg.resume or cfg.auto_resume else " with --auto-resume")
    return (f"plait train: the latest complete checkpoint is {found} (step {CheckpointReader(found).meta['step']}); "
            f"{again} continues from it")


def _say_loading(cfg, resumed: tuple[Path, int] | None) -> None:
    """On a terminal: the checkpoint a resumed run reads (weights and optimizer state), or the Hugging Face
    folder's weights a fresh one starts from (plait.cli.progress.loading)."""
    from plait.cli.progress import loading

    if resumed is not None:
        size = sum(f.stat().st_size for f in resumed[0].glob("*.safetensors"))
        loading("train", str(resumed[0]), size, "the weights and optimizer state of")
    elif (Path(cfg.model) / "config.json").is_file():
        from plait.generation.job import weights_size

        loading("train", *weights_size(cfg.model))


def _torchrun_worker(cfg) -> None:
    """This process's share of the run under torchrun; a lost peer ends it in one line (``lost_peer_in_one_line``)."""
    from plait.cli.torchrun import lost_peer_in_one_line
    from plait.cli.train_worker import train_worker

    with lost_peer_in_one_line():
        train_worker(cfg.to_dict())


def _dry_run(cfg, resumed: tuple[Path, int] | None) -> None:
    """``--dry-run``: the checkpoint a --resume would continue (read and checked by ``check_resume``) and what it
    holds, the prediction printed (and written as one --metrics line), nothing launched."""
    import json

    from rich.console import Console
    from rich.table import Table

    from plait.cli.predict import dry_run
    from plait.train.report import layout_text

    world = cfg.nproc or cfg.world
    row = dry_run(cfg, world)
    console = Console()
    _say_resume(console, cfg, resumed, cfg.parallel.resolve(world))
    t = Table(title=f"plait train --dry-run: {layout_text(cfg.parallel.resolve(world))}; memory of a GPU, MiB",
              title_justify="left")
    # "transient": what the step holds beside the activations at their peak without saving it for the backward
    # (bf16 weight copies, the loss's backward: plait.plan.memory.step_transients); "step peak": the sum at that
    # moment (with the gradients held then, and a recomputed layer's or ZeRO-3's working set)
    for name in ("pp rank", "params", "grads", "optimizer", "activations peak", "transient", "step peak"):
        t.add_column(name, justify="right", min_width=max(map(len, name.split())))  # wrapped at spaces, not cut
    kinds = ("params", "grads", "optimizer", "activations_peak")
    for m in row["memory"]["predicted"]:
        parts = [m[k] for k in kinds] + [m["weight_copies"] + m["loss_backward"], m["total"]]
        t.add_row(str(m["pp_rank"]), *(f"{b / 2**20:.2f}" for b in parts))
    console.print(t)
    for note in row["memory"]["notes"]:
        console.print(f"note: {note}")
    source = row["predicted_on"] + (f" ({cfg.cluster})" if cfg.cluster else "")
    console.print(f"predicted step time {row['predicted_step_time_s'] * 1e3:,.0f} ms, bubble "
                  f"{row['predicted_bubble']:.1%} (idle share of the step), on {source}; nothing was launched")
    if cfg.metrics:
        with open(cfg.metrics, "a") as f:
            f.write(json.dumps(row) + "\n")


def _say_resume(console, cfg, resumed: tuple[Path, int] | None, layout) -> None:
    """What a --dry-run with --resume or --auto-resume would continue, as the run's first lines would say it: the
    checkpoint and what it holds (``_holds``), the newer folders passed over, the layout it would be resharded to
    (``layout``, resolved), the settings changed since it was saved; or, with --auto-resume, a fresh start."""
    from functools import partial

    from rich.markup import escape

    from plait.checkpoint import CheckpointReader, incomplete_checkpoints
    from plait.train.restart import passed_over
    from plait.train.resume import SHARDING, continuing, saved_layout

    if not (cfg.resume or cfg.auto_resume):
        return
    say = partial(console.print, soft_wrap=True)  # a path stays whole on one line
    passed = passed_over(incomplete_checkpoints(cfg.checkpoint_dir, resumed[0] if resumed else None))
    if passed:
        say(f"[yellow]note: {escape(passed)}; passed over[/]")
    if resumed is None:  # --resume without one was refused before
        say(f"--auto-resume: no complete checkpoint in {cfg.checkpoint_dir}: would start fresh", markup=False)
        return
    say(_holds(*resumed), markup=False)
    note, resharded = continuing(CheckpointReader(resumed[0]).meta, cfg, layout)
    if resharded:
        now = saved_layout({"layout": {k: getattr(layout, k) for k in SHARDING}})
        say(f"its weights and optimizer state would be resharded from {resharded} to {now}", markup=False)
    if note:
        say(note)


def _holds(path: Path, step: int) -> str:
    """What the checkpoint at ``path`` (of step ``step``) holds, for a --dry-run that would resume it: the layout
    it was saved under, the data its run had read, and whether its tensors were checked."""
    from plait.checkpoint import CheckpointReader
    from plait.checkpoint.checksums import BLOCK_KEY, KEY
    from plait.train.resume import saved_layout

    meta = CheckpointReader(path).meta
    data = meta.get("data") or {}
    seen = f", {data['tokens_seen']:,} tokens seen (epoch {data['epoch']:g})" if "tokens_seen" in data else ""
    checked = any(KEY in s or BLOCK_KEY in s for entry in meta.get("tensors", {}).values() for s in entry["shards"])
    return (f"would resume {path} (step {step}): saved under {saved_layout(meta)}{seen}; "
            + ("every tensor read and matched to its checksum" if checked else "saved without checksums: unchecked"))
