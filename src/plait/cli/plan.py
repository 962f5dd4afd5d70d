"""``plait plan``: choose a layout before booking hardware (training or inference)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import typer

from plait.plan.cluster import MAX_MEMORY_FRACTION

GB = 1e9
PLAN_HELP = """Find the fastest parallel layout that fits, for training (default) or inference.

Searches tensor (TP), pipeline (PP), data (DP), context (CP, from 32k tokens) and expert (EP)
parallelism, micro-batch size, pipeline schedule, recomputation and ZeRO stage; prints the best layouts
with their memory on the most loaded GPU, step time, MFU and why the best wins, and ends with the best
as plait train flags to paste (or why plait train would not run it). Models: docs/planner.md.

\b
Examples:
  plait plan --model llama3-70b --gpus 64 --gpu h100-sxm --gpus-per-node 8
  plait plan --model llama3-405b --gpus 16384 --gpu h100-sxm \\
      --global-batch 2048 --show-schedule
  plait plan --model path/to/config.json --gpus 8 --gpu a100-80gb \\
      --seq-len 4096
  plait plan --model mixtral-8x7b --gpus 64 --global-batch 256 --json
  plait plan --model llama3-70b --gpus 4 --gpu a100-80gb --inference \\
      --batch 8 --prompt-len 2048
  # plait's own processes on a host profiled by plait calibrate:
  plait plan --model small --gpus 4 --cluster host.toml --global-batch 16 \\
      --seq-len 128
  # the same, written as a config file, then a run of it:
  plait plan --model small --gpus 4 --cluster host.toml --global-batch 16 \\
      --seq-len 128 --write-config run.toml
  plait train --config run.toml
  # attention within packed documents (plait train --document-mask) of
  # about 600 tokens each:
  plait plan --model llama3-8b --gpus 8 --seq-len 8192 --global-batch 512 \\
      --document-mask --mean-document-length 600

The bubble is the idle share of the step (the average pipeline rank's idle time over the step time);
the parts of the time breakdown add up to the step. Without --global-batch the batch is searched: the
smallest of 4, 8, 16, 32, 64M tokens whose best layout keeps the bubble under 10% (said in the output).
With --cluster the batch and sequence default to plait train's own (16 sequences of 128 tokens, said in
the output): a GPU cluster's millions of tokens would take a CPU host an hour a step.
"""


def fail(message: str, code: int = 2) -> NoReturn:
    """A one-line error on stderr and exit ``code`` (2: a bad option or file)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def planner_model(name: str, seq_len: int | None):
    """The planner's model of --model: a preset name, a config.json or a Hugging Face folder."""
    from plait.plan import Model

    if name.endswith(".json") or Path(name).is_dir():
        return Model.from_hf_config(name, seq_len=seq_len)
    return Model.preset(name, seq_len=seq_len)


def _training_table(result, title: str):
    from rich.table import Table

    from plait.plan.explain import memory_unit

    t = Table(title=title, header_style="bold")
    unit, scale = memory_unit(result.best)
    # in a narrow terminal the layout and the memory sum wrap at their spaces; the figures keep their width
    # transient: what the step holds beside the activations at their peak (plait.plan.memory.step_transients)
    memory = f"memory {unit}: weights + grads + optim + activ + transient"
    for col in ("#", "layout", "step s", "MFU", "TF/s/GPU", "bubble", memory):
        words = col in ("layout", memory)
        t.add_column(col, justify="left" if col in ("layout", "#") else "right", no_wrap=not words,
                     min_width=None if words else len(col))
    for i, e in enumerate(result.best, 1):
        m = e.memory
        parts = " + ".join(f"{x / scale:.1f}" for x in (m.weights, m.grads, m.optimizer, m.activations,
                                                         m.weight_copies + m.loss_backward))
        label = e.layout.short() + (" padded-rounds" if e.rounds == "padded" else "")
        t.add_row(str(i), label, f"{e.step_time_s:.3g}", f"{e.mfu:.1%}", f"{e.tflops_per_gpu:.3g}",
                  f"{e.bubble_fraction:.1%}", f"{parts} = {m.total / scale:.1f} of {m.usable / scale:,.0f}")
    return t


def _breakdown_table(best):
    from rich.table import Table

    from plait.plan.estimate import PARTS

    t = Table(title=f"time of the best layout's step ({best.layout.short()})", header_style="bold")
    t.add_column("part")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    t.add_column("what")
    for k, v in best.time.items():
        if v > 0 or k in ("compute", "pp_bubble"):
            t.add_row(k, f"{v:.3f}", f"{v / best.step_time_s:.1%}", PARTS[k])
    t.add_row("step", f"{best.step_time_s:.3f}", "100.0%", "the parts add up to the step", style="bold")
    return t


def _show_schedule(console, best) -> None:
    """The best layout's schedule simulated with its per-chunk costs; the bubble quoted is the estimate's."""
    from plait.plan.pipeline import SPLIT_BACKWARD
    from plait.plan.timing import chunk_costs
    from plait.schedules import build_schedule
    from plait.sim import Costs, simulate

    lay = best.layout
    if lay.pp == 1:
        console.print("(no pipeline: pp = 1, micro-batches run one after another)")
        return
    m = min(best.microbatches, 4 * lay.pp)
    ch = chunk_costs(best.cluster.costs, best.model, lay, best.training, best.microbatches)
    weight = [c.weight for c in ch] if lay.schedule in SPLIT_BACKWARD else None
    r = simulate(build_schedule(lay.schedule, stages=lay.pp, microbatches=m, virtual=lay.virtual_stages,
                                rounds=best.rounds),
                 Costs(forward=[c.forward for c in ch], backward=[c.backward for c in ch], weight=weight,
                       p2p=ch[0].p2p))
    shown = f"the first {m} of {best.microbatches}" if m < best.microbatches else f"all {m}"
    console.print(f"[bold]{lay.schedule}[/], pp={lay.pp}, v={lay.virtual_stages}: {shown} micro-batches (times in s); "
                  f"bubble of the whole step {best.bubble_fraction:.1%} (idle share of the step, "
                  f"{best.time['pp_bubble']:.3f} of {best.step_time_s:.3f} s)")
    console.print("\n".join(r.to_ascii(width=100).splitlines()[1:]))  # its own header quotes this part alone


@dataclass(frozen=True)
class PlanOptions:
    """The options of ``plait plan`` (one per field, its help the field's docstring)."""

    model: str
    """preset (llama3-8b, llama3-70b, llama3-405b, gpt3-175b, mixtral-8x7b; tiny, small) or a Hugging Face
    config.json"""
    gpus: int
    """number of GPUs (with --cluster: plait processes on the calibrated host)"""
    gpu: str = "h100-sxm"
    """GPU type, e.g. h100-sxm, a100-80gb"""
    gpus_per_node: int = 8
    """GPUs per node (TP stays inside)"""
    interconnect: str | None = None
    """inter-node fabric, e.g. ib-ndr (default: the GPU's usual)"""
    seq_len: int | None = None
    """sequence length (default: the model's; with --cluster, plait train's 128)"""
    global_batch: int | None = None
    """sequences per step (default: searched, 4-64M tokens; with --cluster, plait train's 16)"""
    top: int = 5
    """how many layouts to show"""
    inference: bool = False
    """plan serving instead"""
    batch: int = 1
    """inference: concurrent sequences"""
    prompt_len: int = 1024
    """inference: prompt tokens"""
    gen_len: int = 256
    """inference: generated tokens"""
    weights: str = "bf16"
    """inference: weights stored as bf16, fp16, fp8, int8 or int4"""
    as_json: bool = False
    """print JSON instead of tables"""
    show_schedule: bool = False
    """Gantt of the best"""
    cluster: Path | None = None
    """a host profile from `plait calibrate`: plan plait's own runs on that host (--gpus processes)"""
    precision: str | None = None
    """bf16 or fp32 (default: fp32 with --cluster, as plait train; bf16 otherwise); bf16 as plait runs it: without
    ZeRO the float32 parameters are their own masters, with a bf16 copy for each step"""
    max_memory_fraction: float = MAX_MEMORY_FRACTION
    """share of each device's memory a layout may use"""
    attention: str = "sdpa"
    """attention kernel, costed at its published speed: sdpa (what plait runs, PyTorch SDPA's pick: cudnn on
    Hopper GPUs and the B200, flash2 elsewhere), flash2 (FlashAttention-2, SDPA's flash backend), flash1,
    triton-ops (OpenAI Triton's triton.ops.flash_attention; A100), cudnn (cuDNN's, as Transformer Engine and
    SDPA run it), flash3 (Hopper) or unfused"""
    elementwise: str = "plait-eager"
    """element-wise kernels (norms, RoPE, activations, residual adds, casts, the loss): plait-eager (plait's
    runtime, each its own kernel: the model plait train --dry-run predicts with) or fused (fused kernels, as the
    Megatron-style runs the GPU model is fitted on)"""
    plan_only: bool = False
    """also consider what only the planner models (ZeRO-3 under a zero-bubble schedule, whose backward is split),
    marked plan-only"""
    expert_capacity: float | None = None
    """MoE: the rows the busiest GPU's experts are counted to receive, in memory and step time, times balanced
    routing's (a capacity factor; default: the model's capacity_factor, else 1, balanced); plait routes dropless,
    so uneven routing keeps and takes more (the output says how much at most: the JSON's dropless_bound)"""
    write_config: Path | None = None
    """write the best layout as a `plait train --config` TOML file"""
    document_mask: bool = False
    """plan runs of plait train --document-mask (attention within each packed document): its memory, and its
    attention's time as documents of --mean-document-length tokens cut the rows"""
    mean_document_length: float | None = None
    """with --document-mask (required): the tokens a document of the data averages, its end-of-document token
    included (plait train --dry-run --document-mask reads the lengths of its --data instead)"""


#: options that only serving plans read (with --inference), and those only training plans read (without)
INFERENCE_ONLY = ("batch", "prompt_len", "gen_len", "weights")
TRAINING_ONLY = ("global_batch", "show_schedule", "write_config", "plan_only", "precision", "elementwise",
                 "document_mask", "mean_document_length")


def _check_mode(o: PlanOptions) -> None:
    """ConfigError naming the options set away from their defaults that the chosen plan would not read: the
    hardware options with --cluster, serving options without --inference (--batch is no training batch: that is
    --global-batch), training options with it."""
    from plait.cli.options import set_away
    from plait.errors import ConfigError

    hardware = set_away(o, ("gpu", "gpus_per_node", "interconnect", "attention"))
    if o.cluster is not None and hardware:
        raise ConfigError(f"{hardware}: not with --cluster, whose profile measured the host's devices (their "
                          "speed, links and memory)")
    said = set_away(o, TRAINING_ONLY if o.inference else INFERENCE_ONLY)
    if said:
        raise ConfigError(f"{said}: {'training' if o.inference else 'serving'} option{'s' * (',' in said)}, "
                          + ("which --inference ignores (its batch is --batch)" if o.inference else
                             "which only --inference reads (a training plan's batch is --global-batch)"))


def plan(options: dict[str, Any]) -> None:
    from rich.console import Console

    from plait.cli.plan_config import flags_line, plan_flags, write_config
    from plait.cli.plan_inference import inference
    from plait.errors import ConfigError, flag_message
    from plait.plan import Cluster, Training, explain, search
    from plait.plan.attention import KERNELS, SDPA, UNFUSED
    from plait.plan.documents import note as documents_note
    from plait.plan.experts import dropless_bound, routing_note
    from plait.plan.explain import nothing_fits
    from plait.plan.optimizers import RUNTIME_MASTERS
    from plait.plan.search import search_batch

    o = PlanOptions(**options)
    try:
        _check_mode(o)
    except ConfigError as exc:
        fail(str(exc))
    batch_note = ""
    if o.cluster is not None and not o.inference:
        o, batch_note = _host_run(o)
    if o.attention not in (SDPA, *KERNELS, UNFUSED):  # the library also takes True and False, which no flag spells
        fail(f"--attention {o.attention!r}: unknown kernel; valid: {SDPA}, {', '.join(KERNELS)}, {UNFUSED}")
    # a terminal's width (or COLUMNS, when set); else, into a file or a pipe, wide enough for one row a layout
    console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 140)
    try:
        m = planner_model(o.model, o.seq_len)
        if o.expert_capacity is not None:
            m = replace(m, expert_capacity=o.expert_capacity)
        if o.cluster is not None:
            cluster = Cluster.from_profile(o.cluster, o.gpus, max_memory_fraction=o.max_memory_fraction)
        else:
            cluster = Cluster(o.gpu, o.gpus, o.gpus_per_node, o.interconnect, max_memory_fraction=o.max_memory_fraction,
                              flash_attention=o.attention)
        if o.inference:
            inference(console, m, cluster, o.batch, o.prompt_len, o.gen_len, o.as_json, o.weights)
            return
        precision = o.precision or ("fp32" if o.cluster is not None else "bf16")
        documents = plan_documents(o, m.seq_len)
        if o.global_batch is not None:
            training = Training(o.global_batch, precision=precision, elementwise=o.elementwise,
                                masters=RUNTIME_MASTERS, document_mask=o.document_mask, documents=documents)
            result = search(m, cluster, training, top=o.top, plan_only=o.plan_only)
        else:
            choice = search_batch(m, cluster, top=o.top, precision=precision, plan_only=o.plan_only,
                                  elementwise=o.elementwise, masters=RUNTIME_MASTERS, documents=documents)
            training = Training(choice.global_batch, precision=precision, elementwise=o.elementwise,
                                masters=RUNTIME_MASTERS, document_mask=o.document_mask, documents=documents)
            result = choice.result
            batch_note = f"global batch (not given, searched): {choice.reason}"
        if result.best and o.write_config is not None:
            write_config(o.write_config, result.best[0], o.model)
    except ConfigError as exc:
        fail(flag_message(exc))
    if not result.best:
        fail(f"{m.name} on {o.gpus} × {cluster.gpu.name}: " + nothing_fits(result, m, cluster.usable_memory,
                                                                            cluster.n_gpus), 1)
    if o.as_json:
        out: dict[str, Any] = {"best": [e.to_dict() for e in result.best], "global_batch": training.global_batch,
                               "elementwise": training.elementwise, "global_batch_note": batch_note,
                               "rejected": dict(result.rejected), "pruned": result.pruned, "twins": result.twins,
                               "twin_settings": dict(result.twin_settings), "considered": result.considered,
                               "why": explain(result), "max_memory_fraction": o.max_memory_fraction,
                               "expert_capacity": m.expert_capacity if m.is_moe else None,
                               "dropless_bound": dropless_bound(m, result.best[0].layout) if m.is_moe else None,
                               "train_flags": plan_flags(result.best[0], o.model, o.cluster),
                               "document_mask": documents_note(m, result.best[0].layout, documents)
                               if o.document_mask else None}
        typer.echo(json.dumps(out, indent=1))
        return
    size = f"{m.n_params() / 1e9:.1f}B" if m.n_params() >= 1e9 else f"{m.n_params() / 1e6:.1f}M"
    title = (f"{m.name} ({size}, seq {m.seq_len}) on {o.gpus} × {cluster.gpu.name}, "
             f"{cluster.gpus_per_node}/node; global batch {training.global_batch}, {precision}"
             + ("" if o.cluster is not None else f", {o.elementwise} element-wise kernels"))
    if batch_note:
        console.print(batch_note)
    console.print(_training_table(result, title))
    console.print(_breakdown_table(result.best[0]))
    for line in explain(result):
        console.print("• " + line)
    # a line to copy whole: the terminal wraps it, no line break is put in it
    console.print("• " + flags_line(result.best[0], o.model, o.cluster), markup=False, highlight=False, soft_wrap=True)
    if m.is_moe:
        console.print("• " + routing_note(m, result.best[0].layout))
    if o.document_mask:
        console.print("• " + documents_note(m, result.best[0].layout, documents))
    if o.show_schedule:
        _show_schedule(console, result.best[0])


def plan_documents(o: PlanOptions, seq_len: int):
    """``Training.documents`` of --document-mask: documents of --mean-document-length tokens (None without the
    mask). ConfigError for either option without the other."""
    from plait.errors import ConfigError
    from plait.plan.documents import DocumentLengths

    if o.mean_document_length is not None and not o.document_mask:
        raise ConfigError("--mean-document-length: only with --document-mask (the documents attention keeps to)")
    if not o.document_mask:
        return None
    if o.mean_document_length is None:
        raise ConfigError("--document-mask: give --mean-document-length N, the tokens a document of the data "
                          "averages (its end-of-document token included): the attention's time depends on it")
    return DocumentLengths.of_mean(o.mean_document_length, seq_len)


def _host_run(o: PlanOptions) -> tuple[PlanOptions, str]:
    """``o`` with plait train's default batch and sequence where they are not given (a calibrated host's run: the
    batch search's sizes are a GPU cluster's), and the line saying which were defaulted ("" if neither)."""
    from plait.train.config import TrainConfig

    unset = [flag for flag, value in (("--global-batch", o.global_batch), ("--seq-len", o.seq_len)) if value is None]
    o = replace(o, global_batch=o.global_batch or TrainConfig.batch_size, seq_len=o.seq_len or TrainConfig.seq_len)
    note = (f"global batch {o.global_batch} of {o.seq_len}-token sequences (plait train's default, for a calibrated "
            f"host; {' / '.join(unset)} to set)")
    return o, note if unset else ""


def register(app: typer.Typer) -> None:
    from plait.cli.options import dataclass_options, with_options

    json_flag = {"as_json": "--json"}
    command = app.command("plan", help=PLAN_HELP,
                          short_help="Find the fastest layout that fits, to train or serve.")
    command(with_options(dataclass_options(PlanOptions, flags=json_flag), "options")(plan))
