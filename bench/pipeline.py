"""Benchmark: plait's pipeline runtime vs its own simulation and vs torch.distributed.pipelining.

Sleep workload (compute-free, so 2 cores can host 4 ranks): 8 layers on 4 ranks; each layer's forward
sleeps t, its backward 2t (input-gradient t + weight-gradient t, the weight part deferred to W passes
by zero-bubble schedules, in plait via its WeightGradStore and in torch via ``dw_builder``). For each
schedule: plait's measured step / plait's simulated makespan, and plait / torch on the same workload,
trials alternating in one launch. Then a real-compute run (small Llama, pp=2) with measured vs
predicted bubble.

    .venv/bin/python bench/pipeline.py [--t-ms 8] [--trials 5] [--schedules gpipe,1f1b,...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

LAYERS, RANKS, MICROBATCHES = 8, 4, 8
PAIRS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
         "looped-bfs": "ScheduleLoopedBFS", "zb-h1": None, "zbv": "ScheduleZBVZeroBubble",
         "dualpipev": "ScheduleDualPipeV"}


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, t, store):
        ctx.save_for_backward(x)
        ctx.t, ctx.store, ctx.w = t, store, w
        time.sleep(t)
        return x * w

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        time.sleep(ctx.t)  # input gradient

        def weight_grad(w=ctx.w, g=g, x=x, t=ctx.t):
            time.sleep(t)
            w.grad = (g * x).sum() if w.grad is None else w.grad + (g * x).sum()

        if ctx.store is None:
            weight_grad()
        else:
            ctx.store.defer_or_run(weight_grad)
        return g * ctx.w.detach(), None, None, None


class SleepLayer(nn.Module):
    """Forward sleeps t, backward sleeps t (input grad) + t (weight grad, deferrable)."""

    wgrad_store = None  # set by plait's runtime (zero-bubble schedules) or by the torch harness

    def __init__(self, t: float):
        super().__init__()
        self.t = t
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _Sleep.apply(x, self.w, self.t, self.wgrad_store)


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _plait_runner(name: str, t: float, ctx):
    import plait
    from plait.sim import Costs, simulate

    v = 2 if name in ("interleaved-1f1b", "looped-bfs") else 1
    model = nn.Sequential(*[SleepLayer(t) for _ in range(LAYERS)])
    pm = plait.parallelize(model, ctx, schedule=name, microbatches=MICROBATCHES, virtual_stages=v,
                           loss_fn=_mse, partition="uniform")
    per_stage = LAYERS // RANKS * t * 1000.0
    sim = simulate(pm.schedule, Costs(forward=per_stage, backward=2 * per_stage, weight=per_stage))
    x, y = torch.ones(MICROBATCHES * 2, 16), torch.zeros(MICROBATCHES * 2, 16)

    def traced() -> tuple[float, float]:
        """(measured makespan, makespan simulated with the costs measured in that step), ms."""
        pm.train_step(x, y, trace=True)
        report = pm.trace_report()
        return report.measured.makespan, report.simulated.makespan

    return (lambda: pm.train_step(x, y)), sim.makespan, traced


def _torch_runner(name: str, t: float, rank: int):
    from torch.distributed import pipelining

    from plait.weight_grad import WeightGradStore

    cls_name = PAIRS[name]
    if cls_name is None:
        return None
    cls = getattr(pipelining, cls_name)
    v = 1 if name in ("gpipe", "1f1b") else 2
    n = RANKS * v
    indices = [rank, 2 * RANKS - 1 - rank] if name in ("zbv", "dualpipev") else [rank + k * RANKS for k in range(v)]
    per = LAYERS // n
    stages = []
    for idx in indices:
        store = WeightGradStore()
        store.key = (0, 0)
        store.queues[(0, 0)] = []
        layers = [SleepLayer(t) for _ in range(per)]
        for layer in layers:
            layer.wgrad_store = store

        def dw_builder(store=store):
            queued, store.queues[(0, 0)] = store.queues[(0, 0)], []
            return lambda: [fn() for fn in queued]

        stages.append(pipelining.PipelineStage(nn.Sequential(*layers), idx, n, torch.device("cpu"),
                                               dw_builder=dw_builder))
    sched = cls(stages if v > 1 else stages[0], MICROBATCHES, loss_fn=_mse)
    x, y = torch.ones(MICROBATCHES * 2, 16), torch.zeros(MICROBATCHES * 2, 16)
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


def _sleep_rank(names: list[str], t: float, trials: int) -> list[dict]:
    import plait

    ctx = plait.init(tp=1, pp=RANKS, dp=1)
    rows = []
    for name in names:
        ours, sim_ms, traced = _plait_runner(name, t, ctx)
        try:
            theirs = _torch_runner(name, t, ctx.rank)
            theirs_error = None
        except Exception as exc:  # reported in the table, not hidden
            theirs, theirs_error = None, f"{type(exc).__name__}: {str(exc)[:60]}"
        _timed(ours)
        if theirs:
            _timed(theirs)
        a, b = [], []
        for _ in range(trials):
            a.append(_timed(ours))
            if theirs:
                b.append(_timed(theirs))
        ratios = []
        for _ in range(trials):
            measured, simulated = traced()
            ratios.append(measured / simulated if simulated else float("nan"))
        plait_ms = statistics.median(a)
        torch_ms = statistics.median(b) if b else None
        rows.append({"schedule": name, "sim_ms": sim_ms, "plait_ms": plait_ms, "torch_ms": torch_ms,
                     "plait_vs_sim": plait_ms / sim_ms if sim_ms else None,
                     "plait_vs_torch": plait_ms / torch_ms if torch_ms else None,
                     "torch_vs_sim": torch_ms / sim_ms if torch_ms and sim_ms else None, "torch_note": theirs_error,
                     "traced_vs_measured_cost_sim": statistics.median(ratios)})
    return rows


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


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from plait.distributed.launch import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--t-ms", type=float, default=8.0)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--schedules", default=",".join(PAIRS))
    args = parser.parse_args()
    names = args.schedules.split(",")
    rows = run_world(_sleep_rank, RANKS, names, args.t_ms / 1000.0, args.trials, timeout_s=3600)[0]
    table = Table(title=f"sleep workload: {LAYERS} layers on {RANKS} ranks, M={MICROBATCHES}, t={args.t_ms} ms")
    for col in ("schedule", "sim ms", "plait ms", "torch ms", "plait/sim", "plait/sim(measured costs)",
                "plait/torch", "torch/sim"):
        table.add_column(col, justify="right")
    for r in rows:
        def fmt(v, f):
            return ("n/a" if v is None else format(v, f))
        table.add_row(r["schedule"], f"{r['sim_ms']:.1f}", f"{r['plait_ms']:.1f}", fmt(r["torch_ms"], ".1f"),
                      fmt(r["plait_vs_sim"], ".3f"), fmt(r["traced_vs_measured_cost_sim"], ".3f"),
                      fmt(r["plait_vs_torch"], ".3f"), fmt(r["torch_vs_sim"], ".3f"))
    console = Console(width=120)
    console.print(table)
    llama = {s: run_world(_llama_rank, 2, s, timeout_s=600)[0] for s in ("1f1b", "zb-h1")}
    t2 = Table(title="real compute: Llama dim 128, 4 layers, pp=2, M=8 (2 CPU processes)")
    for col in ("schedule", "measured ms", "simulated ms", "measured bubble", "predicted bubble"):
        t2.add_column(col, justify="right")
    for s, r in llama.items():
        t2.add_row(s, f"{r['measured_makespan_ms']:.1f}", f"{r['simulated_makespan_ms']:.1f}",
                   f"{r['measured_bubble']:.1%}", f"{r['predicted_bubble']:.1%}")
    console.print(t2)
    print(json.dumps({"benchmark": "pipeline", "sleep": rows, "llama_pp2": llama}, indent=1))


if __name__ == "__main__":
    main()
