"""Benchmark: plait's pipeline runtime vs the nominal simulation, a minimal loop (the floor) and torch.

Sleep workload (bench/pipeline_floor.py; compute-free, so 2 cores host 4 ranks): 8 layers on 4 ranks,
M micro-batches; a stage's forward sleeps ``--stage-ms`` (8), its backward twice that (input gradient +
weight gradient, the weight part deferred to W passes by zero-bubble schedules). Each chunk's forward
and backward are first timed alone, outside any runtime; the nominal simulation is the schedule fed
with those costs, so a ratio above 1 is the runtime's own work plus the transport. Per schedule, in
one launch with trials alternating: the floor (a minimal loop over the same action list), plait, and
torch.distributed.pipelining on the same layers. Then a real-compute run (small Llama, pp=2) with
measured vs predicted bubble.

    .venv/bin/python bench/pipeline.py [--stage-ms 8] [--trials 5] [--schedules gpipe,1f1b,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from pipeline_floor import WIDTH, MinimalLoop, SleepLayer, measure_chunk, mse
from torch import nn

LAYERS, RANKS = 8, 4
#: row name -> (plait schedule, virtual, micro-batches, torch class or None)
CASES = {
    "gpipe": ("gpipe", 1, 8, "ScheduleGPipe"),
    "1f1b": ("1f1b", 1, 8, "Schedule1F1B"),
    "interleaved-1f1b": ("interleaved-1f1b", 2, 8, "ScheduleInterleaved1F1B"),
    "interleaved-1f1b/m10": ("interleaved-1f1b", 2, 10, "ScheduleInterleaved1F1B"),
    "looped-bfs": ("looped-bfs", 2, 8, "ScheduleLoopedBFS"),
    "zb-h1": ("zb-h1", 1, 8, None),
    "zb-h1/v2": ("zb-h1", 2, 8, "ScheduleInterleavedZeroBubble"),
    "zbv": ("zbv", 2, 8, "ScheduleZBVZeroBubble"),
    "dualpipev": ("dualpipev", 2, 8, "ScheduleDualPipeV"),
}
DEFAULT = "gpipe,1f1b,interleaved-1f1b,interleaved-1f1b/m10,zb-h1/v2,zbv"
#: how trials (and cost samples) are summarised: the median, or the minimum (the least disturbed trial, for
#: a machine other jobs load)
STATS = {"median": statistics.median, "min": min}


def _layers(n: int, t: float, store=None) -> nn.Sequential:
    layers = [SleepLayer(t) for _ in range(n)]
    for layer in layers:
        layer.wgrad_store = store
    return nn.Sequential(*layers)


def _cost_sampler(schedule, t: float, rank: int, stat):
    """Times each of this rank's chunks alone, outside any runtime; called between trials so that the
    costs see the same machine load as the runs. ``nominal()`` simulates the schedule with the medians."""
    import torch.distributed as dist

    from plait.sim import Costs, simulate
    from plait.weight_grad import WeightGradStore

    split = any(a.kind == "I" for row in schedule.actions for a in row)
    n = schedule.num_stages
    stores = {c: WeightGradStore() if split else None for c in schedule.stages_of_rank(rank)}
    chunks = {c: (_layers(LAYERS // n, t, store), store) for c, store in stores.items()}  # the layers defer W into it
    samples: dict[int, list[tuple[float, float, float]]] = {c: [] for c in chunks}

    def sample() -> None:
        for c, (chunk, store) in chunks.items():
            samples[c].append(measure_chunk(chunk, store, repeats=3))

    def nominal() -> tuple[float, dict]:  # the costs' ``stat`` over the samples, as for the runs
        mine = {c: tuple(stat([s[k] for s in v]) for k in range(3)) for c, v in samples.items()}
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        costs = {c: v for part in parts for c, v in part.items()}
        f, b, w = ([costs[c][k] for c in range(n)] for k in range(3))
        sim = simulate(schedule, Costs(forward=f, backward=b, weight=w if split else None)).makespan
        return sim, {"forward_ms": f, "backward_ms": b, "weight_ms": w if split else None}

    return sample, nominal


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(m * 2, WIDTH), torch.zeros(m * 2, WIDTH)


def _plait_runner(case: str, t: float, ctx):
    import plait

    name, v, m, _ = CASES[case]
    pm = plait.parallelize(_layers(LAYERS, t), ctx, schedule=name, microbatches=m, virtual_stages=v,
                           loss_fn=mse, partition="uniform")
    x, y = _batch(m)
    return (lambda: pm.train_step(x, y)), pm.schedule


def _floor_runner(schedule, t: float, rank: int):
    n = schedule.num_stages
    try:
        loop = MinimalLoop(schedule, rank, {c: _layers(LAYERS // n, t) for c in schedule.stages_of_rank(rank)})
    except ValueError:
        return None
    x, y = _batch(schedule.microbatches)
    xs, ys = list(x.chunk(schedule.microbatches)), list(y.chunk(schedule.microbatches))
    return lambda: loop.step(xs, ys)


def _torch_runner(case: str, t: float, rank: int):
    from torch.distributed import pipelining

    from plait.weight_grad import WeightGradStore

    name, v, m, cls_name = CASES[case]
    if cls_name is None:
        return None
    n = RANKS * v
    indices = [rank, 2 * RANKS - 1 - rank] if name in ("zbv", "dualpipev") else [rank + k * RANKS for k in range(v)]
    stages = []
    for idx in indices:
        store = WeightGradStore()

        store.key, store.queues[(0, 0)] = (0, 0), []  # always defer; torch runs the builder's runner at W
        # (or right after the backward for a full B)

        def dw_builder(store=store):
            queued, store.queues[(0, 0)] = store.queues[(0, 0)], []
            return lambda: [fn() for fn in queued]

        chunk = _layers(LAYERS // n, t, store)
        stages.append(pipelining.PipelineStage(chunk, idx, n, torch.device("cpu"), dw_builder=dw_builder))
    sched = getattr(pipelining, cls_name)(stages if v > 1 else stages[0], m, loss_fn=mse)
    x, y = _batch(m)
    holds_first, holds_last = 0 in indices, n - 1 in indices

    def step():
        args = (x,) if holds_first else ()
        kwargs = {"target": y, "losses": []} if holds_last else {}
        sched.step(*args, **kwargs)

    return step


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return (time.perf_counter() - t0) * 1000.0


def _row(case: str, t: float, trials: int, ctx, stat_name: str) -> dict:
    stat = STATS[stat_name]
    ours, schedule = _plait_runner(case, t, ctx)
    sample, nominal = _cost_sampler(schedule, t, ctx.rank, stat)
    floor = _floor_runner(schedule, t, ctx.rank)
    try:
        theirs, note = _torch_runner(case, t, ctx.rank), None
    except Exception as exc:  # reported in the table, not hidden
        theirs, note = None, f"{type(exc).__name__}: {str(exc)[:60]}"
    runners = {"floor": floor, "plait": ours, "torch": theirs}
    times: dict[str, list[float]] = {k: [] for k, fn in runners.items() if fn is not None}
    for k in times:  # warm-up
        _timed(runners[k])
    for _ in range(trials):  # alternate
        sample()
        for k in times:
            times[k].append(_timed(runners[k]))
    sim_ms, costs = nominal()
    med = {k: stat(v) for k, v in times.items()}
    row = {"case": case, "schedule": schedule.name, "virtual": schedule.virtual, "M": schedule.microbatches,
           "sim_ms": sim_ms, "costs": costs, "torch_note": note, **{f"{k}_ms": med.get(k) for k in runners}}
    for k in ("floor", "plait", "torch"):
        row[f"{k}_vs_sim"] = med[k] / sim_ms if k in med else None
    row["plait_vs_floor"] = med["plait"] / med["floor"] if "floor" in med else None
    row["plait_vs_torch"] = med["plait"] / med["torch"] if "torch" in med else None
    return row


def _sleep_rank(cases: list[str], t: float, trials: int, stat_name: str) -> list[dict]:
    import plait

    ctx = plait.init(tp=1, pp=RANKS, dp=1)
    return [_row(case, t, trials, ctx, stat_name) for case in cases]


def _llama_rank(schedule: str) -> dict:
    import plait
    from plait.models import Llama, LlamaConfig

    ctx = plait.init(tp=1, pp=2, dp=1)
    cfg = LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=4, max_seq_len=64)
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg), ctx, schedule=schedule, microbatches=8)
    tokens = torch.randint(0, 256, (16, 65))
    for _ in range(2):
        pm.train_step(tokens[:, :-1], tokens[:, 1:])
    pm.train_step(tokens[:, :-1], tokens[:, 1:], trace=True)
    return pm.trace_report().summary()


def _fmt(v, f: str) -> str:
    return "n/a" if v is None else format(v, f)


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from plait.distributed.launch import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage-ms", type=float, default=8.0, help="forward of one micro-batch through a stage")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--schedules", default=DEFAULT, help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--no-llama", action="store_true", help="skip the real-compute run")
    parser.add_argument("--stat", choices=list(STATS), default="median",
                        help="summary of the trials and cost samples (min: the least disturbed, on a loaded machine)")
    args = parser.parse_args()
    cases = args.schedules.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    load = os.getloadavg()
    t_layer = args.stage_ms / (LAYERS // RANKS) / 1000.0
    rows = run_world(_sleep_rank, RANKS, cases, t_layer, args.trials, args.stat, timeout_s=3600)[0]
    title = (f"sleep workload: {LAYERS} layers on {RANKS} ranks, forward {args.stage_ms:g} ms per stage, backward "
             f"2x; load {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after; {args.stat} of {args.trials} trials")
    table = Table(title=title)
    for col in ("case", "M", "sim ms", "floor ms", "plait ms", "torch ms", "floor/sim", "plait/sim", "torch/sim",
                "plait/floor", "plait/torch"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["case"], str(r["M"]), f"{r['sim_ms']:.1f}", _fmt(r["floor_ms"], ".1f"),
                      f"{r['plait_ms']:.1f}", _fmt(r["torch_ms"], ".1f"), _fmt(r["floor_vs_sim"], ".3f"),
                      f"{r['plait_vs_sim']:.3f}", _fmt(r["torch_vs_sim"], ".3f"), _fmt(r["plait_vs_floor"], ".3f"),
                      _fmt(r["plait_vs_torch"], ".3f"))
    console = Console(width=140)
    console.print(table)
    for r in rows:
        if r["torch_note"]:
            console.print(f"torch {r['case']}: {r['torch_note']}")
    llama = {}
    if not args.no_llama:
        llama = {s: run_world(_llama_rank, 2, s, timeout_s=600)[0] for s in ("1f1b", "zb-h1")}
        t2 = Table(title="real compute: Llama dim 128, 4 layers, pp=2, M=8 (2 CPU processes)")
        for col in ("schedule", "measured ms", "simulated ms", "measured bubble", "predicted bubble"):
            t2.add_column(col, justify="right")
        for s, r in llama.items():
            t2.add_row(s, f"{r['measured_makespan_ms']:.1f}", f"{r['simulated_makespan_ms']:.1f}",
                       f"{r['measured_bubble']:.1%}", f"{r['predicted_bubble']:.1%}")
        console.print(t2)
    print(json.dumps({"benchmark": "pipeline", "stage_ms": args.stage_ms, "stat": args.stat, "load": load,
                      "sleep": rows, "llama_pp2": llama}, indent=1))


if __name__ == "__main__":
    main()
