"""Benchmark: what one feature costs, predicted and measured, two layouts in one world.

``bench/plan_vs_run.py`` compares every layout's step time with its prediction, one ``plait train`` after
another. On a host whose speed moves by a tenth from one minute to the next, that comparison carries the
host's drift: a layout that ran in a slow minute reads slow. This one asks a narrower question that the
drift cannot touch: by how much does a feature (sequence parallelism, ZeRO, recompute, a schedule) change
the step, against how much the planner says it does?

Each pair is two layouts with the same tp, pp and dp, so one world of processes builds both (plait's own
``plait.train.loop.build``, the model, optimizer and data ``plait train`` makes) and trains them step for
step, alternately (A B, then B A, ...): each step of the variant runs within a few seconds of a step of its
base, on the same processes. The measured ratio is the median over the steps of variant / base (the
slowest rank's time of ``plait.train.loop.train_one`` each, after a barrier); the predicted ratio is the
planner's prediction of the variant over that of the base (``plait.train.predict.predict``, the
prediction ``plait train --cluster`` prints) on the profile. ``spread`` is the interquartile range of the
per-step ratios: how far one pair of steps moves.

What this does not see: anything common to both layouts (the host's speed, a process count's calibration)
cancels out of the ratio. The absolute figures are ``plan_vs_run.py``'s.

Prints a table and JSON. ``--pairs a,b`` picks pairs, ``--steps N`` steps of each layout (two warm-up steps
are dropped), ``--profile FILE`` the calibration (default: this host's cached one, made if missing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

COMMON: dict[str, Any] = {"model": "small", "seq_len": 128, "batch_size": 16, "max_data_mb": 0.5}
MICROBATCHES = 4
WORLD = 4
WARMUP = 2
#: name -> (base layout, variant layout) as ParallelConfig fields; both of WORLD processes, same tp/pp/dp
PAIRS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "sequence parallel (tp2 dp2)": ({"tp": 2, "dp": 2}, {"tp": 2, "dp": 2, "sequence_parallel": True}),
    "sequence parallel (tp4)": ({"tp": 4, "dp": 1}, {"tp": 4, "dp": 1, "sequence_parallel": True}),
    "ZeRO-1 (pp2 dp2)": ({"pp": 2, "dp": 2}, {"pp": 2, "dp": 2, "zero": 1}),
    "ZeRO-2 (pp2 dp2)": ({"pp": 2, "dp": 2}, {"pp": 2, "dp": 2, "zero": 2}),
    "full recompute (tp2 pp2)": ({"tp": 2, "pp": 2, "dp": 1}, {"tp": 2, "pp": 2, "dp": 1, "recompute": "full"}),
    "selective recompute (tp2 dp2)": ({"tp": 2, "dp": 2}, {"tp": 2, "dp": 2, "recompute": "selective"}),
    "gpipe over 1f1b (pp4)": ({"pp": 4, "dp": 1}, {"pp": 4, "dp": 1, "schedule": "gpipe"}),
    "interleaved v2 over 1f1b (pp2 dp2)": ({"pp": 2, "dp": 2},
                                           {"pp": 2, "dp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2}),
    "zbv over 1f1b (pp2 dp2)": ({"pp": 2, "dp": 2}, {"pp": 2, "dp": 2, "schedule": "zbv"}),
    "zbv over 1f1b (pp4)": ({"pp": 4, "dp": 1}, {"pp": 4, "dp": 1, "schedule": "zbv"}),
    "8 micro-batches over 4 (pp4 1f1b)": ({"pp": 4, "dp": 1}, {"pp": 4, "dp": 1, "microbatches": 8}),
}


def config(fields: dict[str, Any], steps: int):
    from plait.parallel_config import ParallelConfig
    from plait.train.config import TrainConfig

    return TrainConfig(parallel=ParallelConfig(**{"microbatches": MICROBATCHES, **fields}), steps=steps, **COMMON)


def same_world(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k, 1) == b.get(k, 1) for k in ("tp", "pp", "dp"))


def train_pair(base: dict[str, Any], variant: dict[str, Any], steps: int) -> list[tuple[float, float]]:
    """Entry of each rank: build both layouts in this world and train them alternately; per step, this
    rank's seconds of (base, variant)."""
    import torch.distributed as dist

    import plait
    from plait.train.loop import build, train_one

    cfgs = [config(base, steps), config(variant, steps)]
    ctx = plait.init(config=cfgs[0].parallel)
    runs = [build(c, ctx) for c in cfgs]
    out: list[tuple[float, float]] = []
    for step in range(steps):
        spent = [0.0, 0.0]
        for i in (0, 1) if step % 2 == 0 else (1, 0):
            dist.barrier()
            t0 = time.perf_counter()
            train_one(runs[i], step, trace=False)
            spent[i] = time.perf_counter() - t0
        out.append((spent[0], spent[1]))
    return out


def measure(name: str, steps: int) -> dict[str, Any]:
    from plait.distributed.launch import run_world

    base, variant = PAIRS[name]
    per_rank = run_world(train_pair, WORLD, base, variant, steps, timeout_s=60.0 * steps + 300)
    slowest = [(max(r[s][0] for r in per_rank), max(r[s][1] for r in per_rank)) for s in range(steps)]
    kept = slowest[WARMUP:]
    ratios = sorted(v / b for b, v in kept)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"base_s": statistics.median(b for b, _ in kept), "variant_s": statistics.median(v for _, v in kept),
            "measured_ratio": statistics.median(ratios), "spread": [q[0], q[2]], "steps": len(kept)}


def predicted(name: str, profile) -> tuple[float, float]:
    from plait.train.predict import predict

    base, variant = PAIRS[name]
    pb, pv = (predict(config(fields, 1), profile, WORLD).step_time_s for fields in (base, variant))
    return pb, pv


def main() -> None:
    from plan_vs_run import load  # this folder: the load average, as plan_vs_run.py reports it

    from plait.calibrate import cache_path, calibrate
    from plait.plan.host.profile import HostProfile

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pairs", default=None, help="comma-separated pair names (default: all)")
    parser.add_argument("--steps", type=int, default=12, help="steps of each layout of a pair (the first two "
                                                              "are dropped)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="calibration to predict with (default: this host's cached one, made if missing)")
    args = parser.parse_args()
    names = list(PAIRS) if args.pairs is None else args.pairs.split(",")
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        parser.error(f"--pairs: unknown {unknown}; choose from {list(PAIRS)}")
    if args.steps <= WARMUP:
        parser.error(f"--steps: give more than the {WARMUP} warm-up steps")
    assert all(same_world(*PAIRS[n]) for n in names)  # one world builds both layouts of a pair
    path = args.profile or cache_path()
    profile = HostProfile.load(path) if path.is_file() else calibrate(out=path)[0]
    rows, loads = [], [load()]
    for name in names:
        t0 = time.perf_counter()
        row = {"pair": name, **measure(name, args.steps)}
        pb, pv = predicted(name, profile)
        row.update(predicted_base_s=pb, predicted_variant_s=pv, predicted_ratio=pv / pb,
                   error=row["measured_ratio"] / (pv / pb) - 1, seconds=time.perf_counter() - t0)
        rows.append(row)
        loads.append(load())
    print(f"profile {path} (the mean of {profile.calibrations}); load average before and after each pair: "
          f"{', '.join(loads)} ({os.cpu_count()} cores)")
    print(f"{'pair':44} {'base ms':>8} {'variant':>8} {'measured':>8} {'spread':>11} {'predicted':>9} {'error':>6}")
    for r in rows:
        lo, hi = r["spread"]
        print(f"{r['pair']:44} {r['base_s'] * 1e3:>8.0f} {r['variant_s'] * 1e3:>8.0f} {r['measured_ratio']:>8.3f} "
              f"{lo:>5.2f}-{hi:<5.2f} {r['predicted_ratio']:>9.3f} {r['error']:>+6.1%}")
    print("measured: median over the steps of variant / base, each pair of steps run back to back in one world; "
          "spread: the interquartile range of those ratios; error: measured over predicted ratio, less 1")
    print(json.dumps({"profile": str(path), "calibrations": profile.calibrations, "load": loads,
                      "cores": os.cpu_count(), "steps": args.steps, "pairs": rows}, indent=1))


if __name__ == "__main__":
    main()
