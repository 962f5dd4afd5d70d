"""``plait verify``: prove a layout reproduces a single-device run, tensor by tensor."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

HELP = """Run a small Llama under a layout on local CPU processes and on one device, then compare.

Launches tp*cp*pp*dp Gloo processes, trains one step in parallel (with the schedule you name) and on a
single device from the same seed, and prints the loss, every gradient's error, the logits of an
eval pass and the peak stored activations against the simulator. Exit code 0 means every tensor is
within float32 rounding (loss rel <= 1e-5, gradients rel <= 1e-4), 1 means a mismatch.

\b
Examples:
  plait verify --tp 2 --pp 2 --dp 1 --schedule zbv --microbatches 8
  # ZeRO-3: parameters sharded over dp:
  plait verify --tp 2 --pp 1 --dp 2 --zero 3 --sequence-parallel
  # ZeRO-3 under a pipeline: each stage sharded over dp (two chunks a rank):
  plait verify --tp 1 --pp 2 --dp 2 --zero 3 --schedule interleaved-1f1b
  # context parallelism: a sequence split over 2 ranks:
  plait verify --tp 1 --pp 1 --dp 2 --cp 2
  # long context: documents packed in each row (masked) and a sliding window:
  plait verify --tp 1 --pp 1 --cp 2 --cp-comm ring --document-mask --window 4
  # mixture of experts, 2 expert ranks:
  plait verify --tp 1 --pp 2 --dp 2 --ep 2 --experts 4 --top-k 2
  # also the measured vs simulated timeline:
  plait verify --tp 1 --pp 2 --trace
"""


def result_table(result) -> Table:
    table = Table(title="gradients: parallel vs single device", show_lines=False)
    table.add_column("tensor", overflow="fold")  # a long name (an expert's weight) folds whole, never cut with '…'
    for col in ("shape", "max |diff|", "rel err", ""):
        table.add_column(col, justify="right" if col in ("max |diff|", "rel err") else "left")
    for g in result.grads:
        mark = "[green]ok[/]" if g.ok else "[red]MISMATCH[/]"
        table.add_row(g.name, "x".join(map(str, g.shape)), f"{g.max_abs:.2e}", f"{g.rel:.2e}", mark)
    return table


def verdict_text(result) -> Text:
    """``result.verdict()``, its PASS green or its FAIL red."""
    verdict = result.verdict()
    return Text.assemble((verdict[:4], "bold green" if result.ok else "bold red"), verdict[4:])


def verify_command(
    tied: bool = typer.Option(False, "--tied", help="Tie the input embedding and the output head."),
    layers: int = typer.Option(8, help="Decoder layers of the test model."),
    batch_size: int = typer.Option(16, help="Global batch (sequences)."),
    seq_len: int = typer.Option(16, help="Sequence length."),
    experts: int = typer.Option(1, "--experts", help="Experts per MoE layer (1: dense feed-forward layers)."),
    top_k: int = typer.Option(1, "--top-k", help="Experts each token is routed to."),
    document_mask: bool = typer.Option(False, "--document-mask", help="Pack each row with several documents (an "
                                       "end-of-document token, id 0, about every eighth token) and train with document "
                                       "masking; the single-device run is each document run alone."),
    window: int | None = typer.Option(None, "--window", metavar="N", help="Sliding-window attention on every "
                                      "layer: each query sees at most N keys, itself included (default: causal)."),
    show_trace: bool = typer.Option(False, "--trace", help="Also print the measured vs simulated timeline (with "
                                                         "--json: its 'trace' key)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    parallel: dict | None = None,
) -> None:
    """The ``parallel`` options are ParallelConfig's fields, generated (plait.cli.options)."""
    from plait.cli.options import check_cp_comm
    from plait.cli.progress import layout_words, starting
    from plait.distributed.launch import LaunchError
    from plait.errors import ConfigError, flag_message
    from plait.parallel_config import ParallelConfig
    from plait.verify import EOS, VerifyConfig, check, verify
    from plait.words import counted

    console = Console()
    console.soft_wrap = not console.is_terminal  # into a file or a pipe no line is folded at an assumed 80 columns
    try:
        cfg = VerifyConfig(parallel=ParallelConfig(**(parallel or {})), tie_embeddings=tied, n_layers=layers,
                           batch_size=batch_size, seq_len=seq_len, n_experts=experts, top_k=top_k,
                           document_mask=document_mask, window=window)
        par = cfg.parallel
        starting("verify", cfg.world, layout_words(par))
        check(cfg)
        check_cp_comm(par.cp, par.cp_comm)
        if not as_json:
            cp = f" cp={par.cp} ({par.cp_comm})" if par.cp > 1 else ""
            console.print(f"launching {counted(cfg.world, 'CPU process')}: tp={par.tp}{cp} pp={par.pp} dp={par.dp}, "
                          f"{par.schedule}, {counted(par.num_microbatches, 'micro-batch')} ...")
        result = verify(cfg)
    except ConfigError as exc:
        typer.echo(f"error: {flag_message(exc)}", err=True)
        raise typer.Exit(2) from None
    except LaunchError as exc:
        typer.echo(f"error: {str(exc).splitlines()[0]}", err=True)
        raise typer.Exit(1) from None
    if as_json:  # --trace: the timeline as one more key
        typer.echo(json.dumps({**result.to_dict(), **({"trace": result.trace_text} if show_trace else {})}, indent=2))
        raise typer.Exit(0 if result.ok else 1)
    console.print(result_table(result))
    if document_mask or window is not None:
        docs = f"documents masked (end-of-document token {EOS}), against each run alone" if document_mask else ""
        slide = f"sliding window of {window} keys on every layer" if window is not None else ""
        console.print("long context: " + "; ".join(part for part in (docs, slide) if part))
    if experts > 1:
        split = ", each split over tp" if par.expert_tp and par.tp > 1 else ""
        console.print(f"mixture of experts: {experts} experts, top-{top_k}, ep={par.ep}{split} (loss includes the "
                      "aux loss)")
    console.print(f"loss: parallel {result.loss_parallel:.7f}, single device {result.loss_single:.7f} "
                  f"(rel {result.loss_rel:.1e});  eval logits rel {result.logits_rel:.1e}")
    console.print(f"peak stored activations per pipeline rank: measured {result.peak_measured}, "
                  f"simulator {result.peak_simulated}")
    if show_trace:
        # a chart's rows and headers are as wide as the chart: never folded (a terminal wraps them if it must)
        console.print(result.trace_text, markup=False, highlight=False, soft_wrap=True)
    console.print(verdict_text(result))
    raise typer.Exit(0 if result.ok else 1)


def register(app: typer.Typer) -> None:
    from plait.cli.options import dataclass_options, with_options
    from plait.parallel_config import ParallelConfig
    from plait.verify import VERIFY_PARALLEL

    options = dataclass_options(ParallelConfig, VERIFY_PARALLEL, exclude=("precision",))  # no optimizer
    command = app.command("verify", help=HELP,
                          short_help="Check a layout's loss and gradients against one device.")
    command(with_options(options, into="parallel")(verify_command))
