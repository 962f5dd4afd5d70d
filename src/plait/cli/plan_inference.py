"""``plait plan --inference``: the serving layouts' tables and the verdict (which ``plait topo`` shares)."""

from __future__ import annotations

import json

import typer

from plait.cli.plan import fail


def inference(console, model, cluster, batch: int, prompt: int, gen: int, as_json: bool, weights: str) -> None:
    """The serving plan of ``model`` on ``cluster`` for the workload: its tables (or JSON) and the best layout."""
    from plait.plan import Workload, plan_inference

    res = plan_inference(model, cluster, Workload(batch, prompt, gen), weights=weights)
    if as_json:
        typer.echo(json.dumps({"best": res.best.to_dict() if res.best else None,
                               "options": [o.to_dict() for o in res.options]}, indent=1))
        return
    title = (f"{model.name} inference on {cluster.n_gpus} × {cluster.gpu.name}, {weights} weights: batch {batch}, "
             f"prompt {prompt}, {gen} new tokens")
    for table in inference_tables(res, title):
        console.print(table)
    if res.best is None:
        fail(f"{model.name} fits no serving layout on {cluster.n_gpus} × {cluster.gpu.name}; "
              f"it needs {model.n_params() * WEIGHT_GB[weights]:.0f} GB for {weights} weights alone", 1)
    for line in inference_verdict(res):
        console.print(line)


WEIGHT_GB = {"bf16": 2e-9, "fp16": 2e-9, "fp8": 1e-9, "int8": 1e-9, "int4": 0.5e-9}


def inference_tables(res, title: str):
    """The serving layouts' memory, then their time: two tables of a few columns each, so that each fits an
    80-column terminal (one table of every column did not: rich cut its figures to "…")."""
    from rich.table import Table

    memory = Table(title=f"{title}: memory", header_style="bold", caption=kv_room_caption(res),
                   caption_justify="left")
    for col in ("layout", "fits", "weights GB", "KV GB", "total GB", "max batch", "KV tok/seq"):
        memory.add_column(col, justify="left" if col == "layout" else "right", no_wrap=True)
    time = Table(title=f"{title}: time", header_style="bold")
    for col in ("layout", "ms/token", "TTFT ms", "request s", "tok/s", "TP all-reduce"):
        time.add_column(col, justify="left" if col in ("layout", "TP all-reduce") else "right",
                        no_wrap=col != "TP all-reduce")
    for o in res.options:
        memory.add_row(o.label, "yes" if o.fits else "no", f"{o.weights_gb:.1f}", f"{o.kv_cache_gb:.1f}",
                       f"{o.total_gb:.1f}", str(o.max_batch), f"{o.max_context:,}")
        ar = (f"{o.tp_allreduce_bytes / 1024:,.0f} KiB: {o.tp_allreduce_ms:.1f} ms/token "
              f"({o.tp_latency_ms:.1f} latency)") if o.tp > 1 else "-"
        time.add_row(o.label, f"{o.token_latency_ms:.1f}", f"{o.ttft_ms:.0f}", f"{o.request_ms / 1e3:.2f}",
                     f"{o.throughput_tok_s:,.0f}", ar)
    return memory, time


def kv_room_caption(res) -> str:
    """What the memory table's last two columns count: the KV cache's room in the memory left over, in sequences of
    the workload's length and in tokens per sequence of its batch (not the model's context, said beside it)."""
    w, model = res.workload, res.model
    context = (f"; {model.name}'s own context is {model.context:,} tokens" if model.context is not None
               else "")
    return (f"max batch: sequences of {w.context:,} tokens (prompt + new) whose KV cache fits the memory left, per "
            f"replica. KV tok/seq: tokens of KV cache there for each sequence of a batch of {w.batch}: the "
            f"cache's room, not the model's context{context}.")


def inference_verdict(res) -> list[str]:
    """The best serving layout and why, in the words ``plait plan`` and ``plait topo`` share."""
    b = res.best
    if b is None:
        return ["nothing fits", *_past_context(res)]
    lines = [f"best: {b.label} — {b.request_ms / 1e3:.2f} s per request (TTFT {b.ttft_ms:.0f} ms + "
             f"{res.workload.gen_len - 1} × {b.token_latency_ms:.1f} ms/token, of which memory reads "
             f"{b.breakdown_ms['memory']:.1f} ms and p2p {b.breakdown_ms['p2p']:.1f} ms), {b.throughput_tok_s:,.0f} "
             "tok/s"]
    if b.tp > 1:
        lines.append(f"  its TP all-reduces: 2 per layer of {b.tp_allreduce_bytes / 1024:,.0f} KiB, "
                     f"{b.tp_allreduce_ms:.1f} ms per token, of which {b.tp_latency_ms:.1f} ms is the latency term "
                     f"(2(t-1) hops × {res.cluster.link(b.tp).latency * 1e6:.0f} µs on {res.cluster.link(b.tp).name})")
    lines += [f"  note: {w}" for w in b.warnings]
    return lines + _past_context(res)


def _past_context(res) -> list[str]:
    """A note where the workload's sequences are longer than the model takes (known from its config)."""
    w, model = res.workload, res.model
    if model.context is None or w.context <= model.context:
        return []
    return [f"  note: a sequence here is {w.context:,} tokens (--prompt-len {w.prompt_len} + --gen-len {w.gen_len}), "
            f"longer than {model.name}'s context of {model.context:,} tokens: the model itself takes no more"]
