"""Benchmark: context parallelism — per-rank activation bytes, peak RSS and step time for one long sequence.

4 CPU processes (Gloo), one row of ``S`` tokens per CP group (so dp = 4/cp rows per step), the tiny and small
byte-level presets with ``max_seq_len = S``:
  cp1-none    dp4, each rank trains a whole sequence, nothing recomputed (the memory one device would need)
  cp1-full    dp4, with full recomputation (what fits without CP): the peer
  cp2-<comm>  dp2 x cp2, no recomputation, K/V exchanged by all-gather or by the ring
  cp4-<comm>  cp4, no recomputation
One launch per layout (peak RSS is a per-process high-water mark). Reported per layout: activation bytes
saved for backward (plait's meter, most loaded rank) beside the planner's prediction of them
(``plait.plan.host.costs.eager_activations``: plait's runtime counted tensor by tensor, no host profile needed)
and measured/predicted, peak RSS (most loaded rank), step time (median of the timed steps, slowest rank) and
tokens/s (all rows of the step); ratios of bytes to cp1-none, of tokens/s to cp1-full. torch's own
``context_parallel`` runs only on CUDA fused-attention kernels, so it cannot be the peer on a CPU.

    .venv/bin/python bench/context.py [--cases tiny:4096,tiny:16384,small:4096] [--steps 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

WORLD = 4
LAYOUTS = {  # name -> (cp, cp_comm, recompute)
    "cp1-none": (1, "allgather", "none"),
    "cp1-full": (1, "allgather", "full"),
    "cp2-allgather": (2, "allgather", "none"),
    "cp2-ring": (2, "ring", "none"),
    "cp4-allgather": (4, "allgather", "none"),
    "cp4-ring": (4, "ring", "none"),
}


def _rank(model: str, seq: int, cp: int, comm: str, recompute: str, steps: int) -> dict:
    """One rank: build the layout, one warm-up step, ``steps`` timed steps; bytes and times of this rank."""
    import resource

    import torch
    import torch.distributed as dist

    import plait
    from plait.models import Llama, LlamaConfig
    from plait.train.config import PRESETS

    torch.set_num_threads(1)
    ctx = plait.init(config=plait.ParallelConfig(cp=cp, dp=WORLD // cp, cp_comm=comm, recompute=recompute))
    cfg = LlamaConfig(**{**PRESETS[model], "max_seq_len": seq})
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg), ctx)
    gen = torch.Generator().manual_seed(ctx.dp_rank)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=gen)  # one row per CP group
    x, y = tokens[:, :-1], tokens[:, 1:]
    pm.train_step(x, y, measure_memory=True)  # warm-up, and the saved-activation meter
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        pm.train_step(x, y)
        times.append(time.perf_counter() - t0)
    return {"activations": pm.memory_report()["activations_peak"], "rss": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024, "step_s": statistics.median(times)}


def predicted_activations(model: str, seq: int, name: str) -> float:
    """The planner's bytes saved for backward on a rank of this layout (every rank holds S/cp tokens of one row,
    one pipeline stage, one micro-batch)."""
    import plait
    from plait.plan import Layout, Model
    from plait.plan.host.costs import eager_activations
    from plait.train.config import PRESETS

    cp, comm, recompute = LAYOUTS[name]
    planner_model = Model.from_llama_config({**PRESETS[model], "max_seq_len": seq}, seq, name=model)
    parallel = plait.ParallelConfig(cp=cp, dp=WORLD // cp, cp_comm=comm, recompute=recompute).resolve(WORLD)
    return eager_activations(planner_model, Layout.from_parallel_config(parallel, 1), parallel.precision).chunk(
        planner_model.n_layers, True, True)


def run(model: str, seq: int, name: str, steps: int) -> dict:
    from plait.distributed.launch import run_world

    cp, comm, recompute = LAYOUTS[name]
    load = os.getloadavg()[0]
    ranks = run_world(_rank, WORLD, model, seq, cp, comm, recompute, steps, timeout_s=3600)
    step = max(r["step_s"] for r in ranks)
    measured, predicted = max(r["activations"] for r in ranks), predicted_activations(model, seq, name)
    return {"model": model, "seq": seq, "layout": name, "activations": measured,
            "predicted_activations": predicted, "act_measured_over_predicted": measured / predicted,
            "rss": max(r["rss"] for r in ranks), "step_s": step, "tokens_per_s": (WORLD // cp) * seq / step,
            "load_before": load}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="tiny:4096,tiny:16384,small:4096", help="model:sequence length, ...")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        model, seq = case.split(":")
        done: dict[str, dict] = {}
        for name in args.layouts.split(","):
            row = run(model, int(seq), name, args.steps)
            done[name] = row
            base, peer = done.get("cp1-none", row), done.get("cp1-full", row)
            row |= {"act_ratio": row["activations"] / base["activations"], "rss_ratio": row["rss"] / base["rss"],
                    "tok_s_ratio": row["tokens_per_s"] / peer["tokens_per_s"]}
            rows.append(row)
            print(f"{model:5} S={int(seq):6} {name:14} activations {row['activations'] / 2**20:8.1f} MiB "
                  f"({row['act_ratio']:.2f}), predicted {row['predicted_activations'] / 2**20:8.1f} MiB "
                  f"(measured/predicted {row['act_measured_over_predicted']:.3f})  "
                  f"peak RSS {row['rss'] / 2**20:7.0f} MiB ({row['rss_ratio']:.2f})  "
                  f"step {row['step_s']:7.2f} s  {row['tokens_per_s']:7.0f} tok/s ({row['tok_s_ratio']:.2f})  "
                  f"load {row['load_before']:.1f}", flush=True)
    print(json.dumps(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
