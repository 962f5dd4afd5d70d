"""Benchmark: how steady this host is, and whether a short speed probe can tell how fast a run will go.

A prediction of a step time can only be as close as the host's own speed is steady. This measures that
floor in two parts, and prints a table and JSON:

1. **The probe alone.** One process, one thread, the calibration's host-speed probe
   (``plait.calibrate.kernels.reference_rate``: one linear layer forward and backward) called back to back
   for ``--probe-seconds``. The spread (standard deviation over mean) of the median, mean and fastest call
   in windows of 12 calls (what the probe takes: about 0.06 s), 60 and 240 calls. A spread that stays
   large in long windows is the host's speed moving (a virtual machine's neighbours), not timing noise.
2. **The probe against a run.** ``--processes`` processes (Gloo) repeat: rank 0 takes the probe while the
   others wait; then every process runs plait's decoder layer forward and backward for ``--window``
   seconds (a run's work: GEMMs, attention and element-wise kernels, on every core). Reported: the
   workload's spread between windows, how well one window's speed predicts the next (correlation of their
   logarithms, and the spread of next/previous), and how well the probe taken just before predicts the
   window (correlation, and the spread of workload/probe: a probe that tracks the host makes it smaller
   than the workload's own spread).

``--quick`` runs each part for a few seconds (a smoke run). Nothing else should run meanwhile: the point is
the host's own noise. The default takes about 4 minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

WINDOWS = (12, 60, 240)  # calls per window in part 1 (12: about what one probe takes)
HIDDEN, SEQ, BATCH, HEADS = 256, 128, 4, 8  # the workload's decoder layer ([B, S, h], the `small` preset's width)


def spread(values: list[float]) -> float:
    """Standard deviation over mean."""
    return statistics.pstdev(values) / statistics.mean(values) if len(values) > 1 else float("nan")


def log_correlation(a: list[float], b: list[float]) -> float:
    if len(a) < 3:
        return float("nan")
    return statistics.correlation([math.log(x) for x in a], [math.log(x) for x in b])


def probe_alone(seconds: float) -> dict:
    """Part 1: the probe's calls back to back in this process, one thread."""
    import torch
    import torch.nn.functional as F

    from plait.calibrate.kernels import REFERENCE_SHAPE

    torch.set_num_threads(1)
    t, n, k = REFERENCE_SHAPE
    x = torch.randn(t, k, requires_grad=True)
    w = torch.randn(n, k, requires_grad=True)
    g = torch.randn(t, n)

    def call() -> float:
        t0 = time.perf_counter()
        F.linear(x, w).backward(g)
        return time.perf_counter() - t0

    for _ in range(5):
        call()
    calls: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        calls.append(call())
    out = {"calls": len(calls), "call_ms": statistics.mean(calls) * 1e3, "call_spread": spread(calls), "windows": []}
    for size in WINDOWS:
        groups = [calls[i:i + size] for i in range(0, len(calls) - size + 1, size)]
        if len(groups) < 3:
            continue
        out["windows"].append({"calls": size, "seconds": statistics.mean(calls) * size, "count": len(groups),
                               "median_spread": spread([statistics.median(c) for c in groups]),
                               "mean_spread": spread([statistics.mean(c) for c in groups]),
                               "fastest_spread": spread([min(c) for c in groups])})
    return out


def against_run(processes: int, seconds: float, window: float) -> dict:
    """Part 2: the probe before each window of a decoder-layer workload on every process (a local world)."""
    from plait.distributed.launch import run_world

    return run_world(_rank_main, processes, seconds, window, timeout_s=seconds * 3 + 300)[0]


def _rank_main(seconds: float, window: float) -> dict | None:
    import torch
    import torch.distributed as dist

    from plait.calibrate.kernels import reference_rate
    from plait.distributed.launch import worker_threads
    from plait.models.llama import DecoderLayer, LlamaConfig
    from plait.plan.model import llama_ffn

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.set_num_threads(worker_threads(world))
    cfg = LlamaConfig(dim=HIDDEN, n_layers=1, n_heads=HEADS, n_kv_heads=HEADS, ffn_dim=llama_ffn(HIDDEN),
                      max_seq_len=SEQ)
    layer = DecoderLayer(cfg)
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)  # [B, S, h]
    g = torch.randn_like(x)
    layer(x).backward(g)
    probes: list[float] = []
    work: list[float] = []
    end = time.time() + seconds
    while True:
        stop = [time.time() > end]
        dist.broadcast_object_list(stop, src=0)  # rank 0's clock decides for everyone
        if stop[0]:
            break
        dist.barrier()
        probe = reference_rate(torch.device("cpu")) if dist.get_rank() == 0 else 0.0
        dist.barrier()
        t0 = time.perf_counter()
        calls = 0
        while time.perf_counter() - t0 < window:
            layer(x).backward(g)
            calls += 1
        per_call = torch.tensor([(time.perf_counter() - t0) / calls], dtype=torch.float64)
        dist.all_reduce(per_call)  # the mean over the processes: a step waits for all of them
        probes.append(probe)
        work.append(world / float(per_call))  # decoder layers per second per process
    if dist.get_rank() != 0:
        return None
    ratios = [b / a for a, b in zip(work, work[1:], strict=False)]
    return {"processes": world, "window_s": window, "windows": len(work), "workload_spread": spread(work),
            "next_correlation": log_correlation(work[:-1], work[1:]), "next_over_previous_spread": spread(ratios),
            "probe_spread": spread(probes), "probe_correlation": log_correlation(probes, work),
            "workload_over_probe_spread": spread([w / p for w, p in zip(work, probes, strict=True)])}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds per part (a smoke run)")
    parser.add_argument("--probe-seconds", type=float, default=30.0, help="part 1: seconds of probe calls")
    parser.add_argument("--seconds", type=float, default=200.0, help="part 2: seconds of probe + workload windows")
    parser.add_argument("--window", type=float, default=4.0, help="part 2: seconds of workload per window")
    parser.add_argument("--processes", type=int, default=4, help="part 2: processes running the workload")
    args = parser.parse_args()
    if args.quick:
        args.probe_seconds, args.seconds, args.window = 4.0, 12.0, 1.0
    load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
    alone = probe_alone(args.probe_seconds)
    print(f"part 1: the probe alone, {alone['calls']} calls of {alone['call_ms']:.1f} ms back to back "
          f"(one thread; load average {load}, {os.cpu_count()} cores); spread = std / mean")
    print(f"{'window':>18} {'windows':>8} {'median':>7} {'mean':>7} {'fastest':>8}")
    for w in alone["windows"]:
        print(f"{w['calls']:>5} calls {w['seconds']:>5.2f} s {w['count']:>8} {w['median_spread']:>7.1%} "
              f"{w['mean_spread']:>7.1%} {w['fastest_spread']:>8.1%}")
    run = against_run(args.processes, args.seconds, args.window)
    print(f"part 2: {run['windows']} windows of {run['window_s']:.0f} s of decoder layers on {run['processes']} "
          f"processes, the probe on rank 0 before each")
    print(f"  the workload's speed between windows: spread {run['workload_spread']:.1%}")
    print(f"  one window predicting the next: correlation {run['next_correlation']:.2f}, next/previous spread "
          f"{run['next_over_previous_spread']:.1%}")
    print(f"  the probe predicting the window after it: correlation {run['probe_correlation']:.2f}, workload/probe "
          f"spread {run['workload_over_probe_spread']:.1%} (the probe's own spread {run['probe_spread']:.1%})")
    tracks = run["workload_over_probe_spread"] < run["workload_spread"]
    print(f"verdict: the probe {'tracks' if tracks else 'does not track'} the host's speed over the next window "
          f"(dividing by it {'narrows' if tracks else 'widens'} the workload's spread)")
    print(json.dumps({"load": load, "cores": os.cpu_count(), "probe_alone": alone, "against_run": run,
                      "probe_tracks_run": tracks}, indent=1))


if __name__ == "__main__":
    main()
