"""``plait verify``: prove a layout reproduces a single-device run, tensor by tensor."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

HELP = """Run a small Llama under a layout on local CPU processes and on one device, then compare.

Launches tp*pp*dp Gloo processes, trains one step in parallel (with the schedule you name) and on a
single device from the same seed, and prints the loss, every gradient's error, the logits of an
eval pass and the peak stored activations against the simulator. Exit code 0 means every tensor is
within float32 rounding (loss rel <= 1e-5, gradients rel <= 1e-4), 1 means a mismatch.

Example: plait verify --tp 2 --pp 2 --dp 1 --schedule zbv --microbatches 8
"""


def _table(result) -> Table:
    table = Table(title="gradients: parallel vs single device", show_lines=False)
    for col in ("tensor", "shape", "max |diff|", "rel err", ""):
        table.add_column(col, justify="right" if col in ("max |diff|", "rel err") else "left")
    for g in result.grads:
        mark = "[green]ok[/]" if g.ok else "[red]MISMATCH[/]"
        table.add_row(g.name, "x".join(map(str, g.shape)), f"{g.max_abs:.2e}", f"{g.rel:.2e}", mark)
    return table


def verify_command(
    tp: int = typer.Option(2, help="Tensor-parallel size (ranks that split each layer)."),
    pp: int = typer.Option(2, help="Pipeline-parallel size (ranks that hold consecutive layers)."),
    dp: int = typer.Option(1, help="Data-parallel size (replicas that see different data)."),
    schedule: str = typer.Option("1f1b", help="Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, looped-bfs, "
                                 "zb-h1, zbv, dualpipev."),
    microbatches: int = typer.Option(8, help="Micro-batches per step (per data-parallel replica)."),
    virtual_stages: int | None = typer.Option(None, "--virtual-stages", help="Chunks per pipeline rank V "
                                              "(default 1; 2 for interleaved-1f1b, looped-bfs, zbv, dualpipev)."),
    recompute: str = typer.Option("none", "--recompute", help="Activation recomputation: none, or full (each "
                                  "layer's activations recomputed in the backward; less memory, more time)."),
    sequence_parallel: bool = typer.Option(False, "--sequence-parallel", help="Shard norms/residuals along "
                                           "the sequence between TP regions."),
    tied: bool = typer.Option(False, "--tied", help="Tie the input embedding and the output head."),
    layers: int = typer.Option(8, help="Decoder layers of the test model."),
    batch_size: int = typer.Option(16, help="Global batch (sequences)."),
    seq_len: int = typer.Option(16, help="Sequence length."),
    experts: int = typer.Option(1, "--experts", help="Experts per MoE layer (1: dense feed-forward layers)."),
    top_k: int = typer.Option(1, "--top-k", help="Experts each token is routed to."),
    ep: int = typer.Option(1, "--ep", help="Expert-parallel size: experts spread over ep ranks of dp x tp."),
    expert_tp: bool = typer.Option(False, "--expert-tp", help="Split each expert over the TP group (Megatron "
                                   "expert tensor parallelism); EP then spans DP ranks, so ep must divide dp."),
    show_trace: bool = typer.Option(False, "--trace", help="Also print the measured vs simulated timeline."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    from plait.distributed.launch import LaunchError
    from plait.errors import ConfigError
    from plait.verify import VerifyConfig, check, verify

    cfg = VerifyConfig(tp=tp, pp=pp, dp=dp, schedule=schedule, microbatches=microbatches,
                       virtual_stages=virtual_stages, recompute=recompute, sequence_parallel=sequence_parallel,
                       tie_embeddings=tied,
                       n_layers=layers, batch_size=batch_size, seq_len=seq_len, n_experts=experts, top_k=top_k,
                       ep=ep, expert_tp=expert_tp)
    console = Console()
    try:
        check(cfg)
        if not as_json:
            console.print(f"launching {cfg.world} CPU processes: tp={tp} pp={pp} dp={dp}, {schedule}, "
                          f"{microbatches} micro-batches ...")
        result = verify(cfg)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except LaunchError as exc:
        typer.echo(f"error: {str(exc).splitlines()[0]}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        raise typer.Exit(0 if result.ok else 1)
    console.print(_table(result))
    if experts > 1:
        split = ", each split over tp" if expert_tp and tp > 1 else ""
        console.print(f"mixture of experts: {experts} experts, top-{top_k}, ep={ep}{split} (loss includes the aux "
                      "loss)")
    console.print(f"loss: parallel {result.loss_parallel:.7f}, single device {result.loss_single:.7f} "
                  f"(rel {result.loss_rel:.1e});  eval logits rel {result.logits_rel:.1e}")
    console.print(f"peak stored activations per pipeline rank: measured {result.peak_measured}, "
                  f"simulator {result.peak_simulated}")
    if show_trace:
        console.print(result.trace_text, markup=False, highlight=False)
    verdict = "[bold green]PASS[/]: parallel equals single device" if result.ok else "[bold red]FAIL[/]"
    console.print(verdict)
    raise typer.Exit(0 if result.ok else 1)


def register(app: typer.Typer) -> None:
    app.command("verify", help=HELP)(verify_command)
