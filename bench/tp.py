"""Benchmark: plait's tensor parallelism vs PyTorch DTensor (parallelize_module) on the same shapes.

TP=2 on 2 CPU processes (Gloo). For an MLP and a full decoder layer at several widths, times forward +
backward of plait's Megatron-style layers and of DTensor's ColwiseParallel/RowwiseParallel, trials
alternating in one launch. Prints a table and JSON (ratio = plait / DTensor, lower is better).

    .venv/bin/python bench/tp.py [--dims 64,256,512] [--trials 7] [--iters 10]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch


def _modules(kind: str, dim: int):
    from plait.models.llama import MLP, DecoderLayer, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, dim=dim, n_layers=1, n_heads=max(2, dim // 32), max_seq_len=128)
    torch.manual_seed(0)
    return (MLP(cfg) if kind == "mlp" else DecoderLayer(cfg)), cfg


def _plait_version(module, kind: str, ctx):
    from plait.models.llama import TP_PLAN
    from plait.tensor_parallel.plan import apply_tp_plan

    if kind == "mlp":
        plan = {"m": "region", "m.gate_proj": "colwise", "m.up_proj": "colwise", "m.down_proj": "rowwise"}
    else:  # the Llama plan's entries for one decoder layer
        plan = {"m" + k[len("layers.*"):]: v for k, v in TP_PLAN.items() if k.startswith("layers.*.")}
    holder = torch.nn.Module()
    holder.add_module("m", module)
    apply_tp_plan(holder, plan, ctx, sequence_parallel=False)
    return holder.m


def _dtensor_version(module, kind: str, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if kind == "mlp":
        plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    else:
        plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
        plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                     "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    return parallelize_module(module, mesh, plan)


def _time(module, x, iters: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        inp = x.detach().requires_grad_(True)
        module(inp).sum().backward()
    dist.barrier()
    return (time.perf_counter() - t0) / iters * 1000.0


def _rank(dims: list[int], trials: int, iters: int, tokens: tuple[int, int]) -> list[dict]:
    import plait

    ctx = plait.init(tp=2, pp=1, dp=1)
    rows = []
    for kind in ("mlp", "layer"):
        for dim in dims:
            base, _ = _modules(kind, dim)
            ours = _plait_version(copy.deepcopy(base), kind, ctx)
            theirs = _dtensor_version(copy.deepcopy(base), kind, ctx.mesh["tp"])
            x = torch.randn(*tokens, dim, generator=torch.Generator().manual_seed(1))
            with torch.no_grad():  # same numbers first: the two must compute the same function
                diff = (ours(x) - theirs(x)).abs().max().item()
            _time(ours, x, 2), _time(theirs, x, 2)  # warm-up
            a, b = [], []
            for _ in range(trials):
                a.append(_time(ours, x, iters))
                b.append(_time(theirs, x, iters))
            rows.append({"module": kind, "dim": dim, "plait_ms": statistics.median(a),
                         "dtensor_ms": statistics.median(b), "ratio": statistics.median(a) / statistics.median(b),
                         "max_abs_diff": diff})
    return rows


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from plait.distributed.launch import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64,256,512")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    dims = [int(d) for d in args.dims.split(",")]
    rows = run_world(_rank, 2, dims, args.trials, args.iters, (args.batch, args.seq), timeout_s=1800)[0]
    table = Table(title=f"TP=2 forward+backward, tokens {args.batch}x{args.seq}, 2 Gloo CPU processes")
    for col in ("module", "dim", "plait ms", "DTensor ms", "plait / DTensor", "max |diff|"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["module"], str(r["dim"]), f"{r['plait_ms']:.3f}", f"{r['dtensor_ms']:.3f}",
                      f"{r['ratio']:.2f}x", f"{r['max_abs_diff']:.1e}")
    Console().print(table)
    print(json.dumps({"benchmark": "tp", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
