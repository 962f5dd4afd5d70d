"""Benchmark: train a Llama whose full training state is >= 3x one process's share of this machine, under tp2·pp2.

The model (1.19B parameters, fp32) needs params + grads + AdamW's two moments = 16 B/parameter ≈ 19.1 GB of
training state; the 24 GiB of this machine split evenly over the 4 processes gives each 6 GiB, and the state
is > 3x that: no process could hold it, four hold a quarter each. The model is built on the meta device and
initialised one tensor at a time from a seed (plait.checkpoint.shards.init_local), then trains 3 steps (AdamW).

Per rank: peak RSS (VmHWM), RSS after init, init time, step times, and the bytes of parameters, gradients and
optimizer state measured on the rank, beside the planner's prediction for the same layout
(plait.plan.memory.state_bytes; its mixed-precision bytes per parameter are converted to this fp32 run's:
4 + 4 + 8). The peer measured in the same run is the model's full state: per-rank bytes are shown as ratios
to it, and measured bytes as ratios to the prediction. Prints a table and JSON. Not part of ``make bench``
(run it alone, ``python bench/scale.py``; ``--check`` only prints the sizes). Measured on this 23.5 GiB machine
with nothing else running: each rank peaks 0.9-1.2 GB above its share of the state (torch itself ~0.27 GB, the
saved activations 0.17-0.34 GB, the weight gradients' temporaries), 21.7 GiB over the four ranks. The script
refuses to start without the memory it needs (``--layers N`` for a smaller model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

CFG = dict(vocab_size=32000, dim=2048, n_layers=23, n_heads=16, n_kv_heads=8, max_seq_len=128)
SMALL = dict(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=32)  # --small: a dry run
LAYOUT = dict(tp=2, pp=2, dp=1, microbatches=4, schedule="1f1b")  # --dp, --zero change dp and the ZeRO stage
BATCH, STEPS, SEED = 4, 3, 0
FP32_STATE = 4 + 4 + 8  # bytes per parameter: weights, gradients, two AdamW moments
GiB = 2**30


def _proc_bytes(path: str, field: str) -> int:
    """A ``field: N kB`` line of a /proc file (VmRSS/VmHWM of /proc/self/status, MemAvailable of
    /proc/meminfo), in bytes; 0 where there is no such file."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _status(field: str) -> int:
    return _proc_bytes("/proc/self/status", field)


def rank_main(job: dict) -> dict:
    import torch

    import plait
    from plait.checkpoint.shards import init_local
    from plait.models import Llama, LlamaConfig
    from plait.optim import build_optimizer
    from plait.parallel_config import ParallelConfig

    layout, zero = job["layout"], job["zero"]
    ctx = plait.init(config=ParallelConfig(**layout))
    cfg = LlamaConfig(**job["config"])
    rss0 = _status("VmRSS")
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = Llama(cfg)
    pm = plait.parallelize(model, ctx)
    init_local(pm, SEED)
    init_s = time.perf_counter() - t0
    rss_init, hwm_init = _status("VmRSS"), _status("VmHWM")
    opt = build_optimizer(pm, lr=1e-4, zero=zero, clip=1.0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH * ctx.dp_size, cfg.max_seq_len + 1), generator=g)
    tokens = tokens[ctx.dp_rank * BATCH:(ctx.dp_rank + 1) * BATCH]  # this replica's share of the global batch
    times, losses = [], []
    for _ in range(STEPS):
        t1 = time.perf_counter()
        losses.append(pm.train_step(tokens[:, :-1], tokens[:, 1:]))
        opt.step()
        times.append(time.perf_counter() - t1)
    measured = pm.memory_report()  # bytes on this rank: params, grads, optimizer, activations_peak (first step)
    return {"rank": ctx.rank, "pp_rank": ctx.pp_rank, "tp_rank": ctx.tp_rank, "layers": pm.partition,
            "local_params": sum(p.numel() for p in pm.parameters()), "init_s": init_s, "rss_start": rss0,
            "rss_after_init": rss_init, "hwm_after_init": hwm_init, "peak_rss": _status("VmHWM"),
            "step_s": times, "losses": losses, "measured": measured}


def predicted(cfg, rank: dict, layout: dict, zero: int) -> dict:
    """The planner's weights, grads and optimizer bytes of this rank's stage, fp32 (4, 4, 8 B/param; ZeRO-1
    shards the moments over dp, ZeRO-2 the gradients left after the step too)."""
    from plait.plan import Model
    from plait.plan.config import Layout
    from plait.plan.memory import state_bytes

    model = Model.from_llama_config(cfg, name="scale")
    plan = Layout(tp=layout["tp"], pp=layout["pp"], dp=layout["dp"], zero=zero,
                  microbatch_size=BATCH // layout["microbatches"])
    stage = rank["pp_rank"]
    w, g, o = state_bytes(model, plan, rank["layers"][stage], stage == 0, stage == layout["pp"] - 1, "fp32")
    return {"params": w, "grads": g, "optimizer": o}


def sizes(config: dict, layout: dict) -> dict:
    from plait.models import LlamaConfig
    from plait.plan import Model

    cfg = LlamaConfig(**config)
    n = Model.from_llama_config(cfg).n_params()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    world = layout["tp"] * layout["pp"] * layout["dp"]
    share = total / world
    return {"params": n, "state_bytes": n * FP32_STATE, "machine_bytes": total, "processes": world,
            "share_bytes": share, "state_over_share": n * FP32_STATE / share}


def _need(s: dict, dp: int, zero: int) -> float:
    """Bytes the run needs at its peak: the replicas' weights and (during the backward, also under ZeRO-2)
    gradients, the AdamW moments sharded by ZeRO, and 1.15 GiB per process (measured here at 23 layers,
    tp2·pp2: each rank peaked 0.9-1.2 GB above its share of the state)."""
    n = s["params"]
    moments = 8 * n * (1 if zero else dp)
    return (4 + 4) * n * dp + moments + s["processes"] * 1.15 * GiB


def main() -> int:
    from plait.distributed.launch import run_world
    from plait.models import LlamaConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a dry run on a tiny model (seconds, little memory)")
    parser.add_argument("--check", action="store_true", help="only print the sizes; launch nothing")
    parser.add_argument("--layers", type=int, default=None, help=f"decoder layers (default {CFG['n_layers']})")
    parser.add_argument("--force", action="store_true", help="start even if too little memory looks available")
    parser.add_argument("--dp", type=int, default=LAYOUT["dp"], help="data-parallel replicas (tp2·pp2·dp)")
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2), help="ZeRO stage of the optimizer")
    args = parser.parse_args()
    config = SMALL if args.small else CFG
    if args.layers is not None:
        config = {**config, "n_layers": args.layers}
    layout = {**LAYOUT, "dp": args.dp}
    s = sizes(config, layout)
    print(f"model: {s['params'] / 1e9:.3f}B parameters, fp32 training state {s['state_bytes'] / GiB:.1f} GiB = "
          f"{s['state_over_share']:.2f} x one process's even share ({s['share_bytes'] / GiB:.1f} GiB of "
          f"{s['machine_bytes'] / GiB:.1f} GiB over {s['processes']})", flush=True)
    if args.check:
        return 0
    need = _need(s, layout["dp"], args.zero)
    available = _proc_bytes("/proc/meminfo", "MemAvailable")
    if available and need > available and not args.force:
        print(f"needs ~{need / GiB:.1f} GiB, {available / GiB:.1f} GiB available: not started (fewer --layers, "
              "or --force)", file=sys.stderr)
        return 2
    cfg = LlamaConfig(**config)
    t0 = time.perf_counter()
    job = {"config": config, "layout": layout, "zero": args.zero}
    ranks = sorted(run_world(rank_main, s["processes"], job, timeout_s=3600), key=lambda r: r["rank"])
    wall = time.perf_counter() - t0
    rows = []
    for r in ranks:
        pred = predicted(cfg, r, layout, args.zero)
        row = {"rank": r["rank"], "stage": r["pp_rank"], "tp_rank": r["tp_rank"], "init_s": r["init_s"],
               "step_s_median": statistics.median(r["step_s"]), "peak_rss": r["peak_rss"],
               "rss_after_init": r["rss_after_init"], "measured": r["measured"], "predicted": pred,
               "measured_over_predicted": {k: r["measured"][k] / pred[k] for k in pred if k in r["measured"]},
               "peak_rss_over_full_state": r["peak_rss"] / s["state_bytes"]}
        rows.append(row)
    head = (f"{'rank':>4} {'stage':>5} {'init s':>7} {'step s':>7} {'peak RSS':>9} {'/state':>7} "
            f"{'params GB':>10} {'grads GB':>9} {'optim GB':>9} {'meas/pred p,g,o':>18}")
    print(head)
    print("-" * len(head))
    for row in rows:
        m, q = row["measured"], row["measured_over_predicted"]
        print(f"{row['rank']:>4} {row['stage']:>5} {row['init_s']:>7.1f} {row['step_s_median']:>7.1f} "
              f"{row['peak_rss'] / 1e9:>7.2f}GB {row['peak_rss_over_full_state']:>7.3f} "
              f"{m['params'] / 1e9:>10.2f} {m.get('grads', 0) / 1e9:>9.2f} {m.get('optimizer', 0) / 1e9:>9.2f} "
              f"{q.get('params', 0):>6.3f},{q.get('grads', 0):.3f},{q.get('optimizer', 0):.3f}")
    print(json.dumps({"config": config, "layout": layout, "zero": args.zero, "batch": BATCH, "steps": STEPS, "sizes": s,
                      "wall_s": wall, "losses": ranks[0]["losses"], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
