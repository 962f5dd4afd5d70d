"""Benchmark: how pipeline processes that outnumber the cores share them, measured on one clock.

The calibrated-host prediction (``plait.sim.shared``) runs a pipeline's actions on ``cores`` cores shared
fairly: ``k`` processes inside an action each progress at ``min(1, cores / k)`` of their speed alone, and a
remote input reaches an idle rank after the point-to-point time. This traces real steps of ``small``
(``plait.train.loop.build``, as ``plait train`` makes them; every rank's actions on the host's monotonic
clock) and measures those assumptions directly:

* ``inside``: the seconds all processes spent inside actions; ``delivered``: the integral of
  ``min(k(t), cores)`` over the step, what the cores gave to actions; the milliseconds at each ``k``.
* ``lag``: for every action whose input came from another rank while its own rank was free, its start less
  its producer's end (the hand-off: transfer, wake-up, waiting for a core). Ranks of one host share the
  clock; the executor stamps a start once the input arrived, and an end after posting the sends, so on
  shared cores a producer descheduled in between makes a lag read negative.
* ``efficiency``: for a world with data parallelism, the work alone (the ``inside`` of the same schedule
  on ``dp`` times fewer processes and sequences, one replica, where processes do not outnumber the cores)
  over ``delivered``: the share of their alone speed the cores deliver once shared. The calibration's
  figure for it is the processes per core over a section's slow-down with every process computing (its
  speed alone over its speed shared).

Cases are ``pp2 dp2 1f1b``-style names; each world with ``dp > 1`` runs with its one-replica reference
(``pp2 1f1b`` at half the batch), the two launched alternately ``--rounds`` times each, since the host's
speed moves from one minute to the next; ``--steps N`` traced steps a launch (two warm-up steps dropped).
Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

MICROBATCHES = 4
BATCH = 16  # sequences of 128 tokens per step, over dp replicas
WARMUP = 2
SCHEDULES = {"1f1b": {"schedule": "1f1b"}, "gpipe": {"schedule": "gpipe"}, "zbv": {"schedule": "zbv"},
             "interleaved": {"schedule": "interleaved-1f1b", "virtual_stages": 2}}
DEFAULT = ("pp2 dp2 1f1b", "pp2 dp2 zbv", "pp2 dp2 interleaved")

Row = tuple[str, int, int, float, float]  # action kind, chunk, micro-batch, start, end (perf_counter seconds)
Step = list[list[Row]]  # every process's actions: dp replica 0's pipeline ranks in order, then replica 1's, ...


def parse(case: str) -> tuple[int, int, str]:
    """``pp2 dp2 zbv`` -> (2, 2, "zbv")."""
    pp = dp = 1
    schedule = "1f1b"
    for word in case.split():
        if word.startswith("pp") and word[2:].isdigit():
            pp = int(word[2:])
        elif word.startswith("dp") and word[2:].isdigit():
            dp = int(word[2:])
        elif word in SCHEDULES:
            schedule = word
        else:
            raise SystemExit(f"case {case!r}: {word!r} is not ppN, dpN or one of {sorted(SCHEDULES)}")
    return pp, dp, schedule


def _rank_main(steps: int, pp: int, dp: int, schedule: str, batch_size: int) -> tuple[list[Step], list[int]] | None:
    import torch.distributed as dist

    import plait
    from plait.parallel_config import ParallelConfig
    from plait.train.config import TrainConfig
    from plait.train.data import batch
    from plait.train.loop import build

    pc = ParallelConfig(tp=1, pp=pp, dp=dp, microbatches=MICROBATCHES, **SCHEDULES[schedule])
    ctx = plait.init(config=pc)
    run = build(TrainConfig(parallel=pc, model="small", seq_len=128, batch_size=batch_size, max_data_mb=0.5,
                            steps=steps + WARMUP), ctx)
    sched = run.pm.schedule
    owner = [sched.stage_to_rank(c) for c in range(sched.num_stages)]  # chunk -> pipeline rank
    out: list[Step] = []
    for s in range(steps + WARMUP):
        dist.barrier()
        x, y = batch(run.corpus.train, s, batch_size, 128, run.cfg.seed, (ctx.dp_rank, ctx.dp_size))
        run.pm.train_step(x, y, trace=True)
        run.opt.step()
        stats = run.pm.last_stats
        mine = [(a.kind, a.stage, a.microbatch, stats.started_at + t0, stats.started_at + t1)
                for a, t0, t1 in stats.timeline]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, ((ctx.dp_rank, ctx.pp_rank), mine))
        if s >= WARMUP:
            out.append([rows for _, rows in sorted(every, key=lambda e: e[0])])
    return (out, owner) if dist.get_rank() == 0 else None


def measure(case: str, steps: int, batch_size: int = BATCH) -> tuple[list[Step], list[int]]:
    """Per traced step, every process's actions (``Step``), and the pipeline rank of each chunk."""
    from plait.distributed.launch import run_world

    pp, dp, schedule = parse(case)
    results = run_world(_rank_main, pp * dp, steps, pp, dp, schedule, batch_size, timeout_s=1800)
    return next(r for r in results if r is not None)


def sharing(step: Step, cores: float) -> dict[str, Any]:
    """Span, inside, delivered (seconds) and the seconds at each k of one step's actions on every process."""
    events = sorted((t, d) for rows in step for *_, s, e in rows for t, d in ((s, 1), (e, -1)))
    k, last, delivered, at = 0, events[0][0], 0.0, {}
    for t, d in events:
        delivered += min(k, cores) * (t - last)
        at[k] = at.get(k, 0.0) + t - last
        k, last = k + d, t
    inside = sum(e - s for rows in step for *_, s, e in rows)
    return {"span": events[-1][0] - events[0][0], "inside": inside, "delivered": delivered, "at": at}


def lags(step: Step, pp: int, owner: list[int], m: int = MICROBATCHES) -> list[float]:
    """Hand-off lags (s) of one step: inputs from another pipeline rank that reached a free rank."""
    from plait.schedules.execute import dependencies

    last = len(owner) - 1
    out = []
    for r0 in range(0, len(step), pp):  # one dp replica's pipeline ranks at a time
        replica = step[r0:r0 + pp]
        ends = {("F" if kind == "F" else "B", c, i): e for rows in replica for kind, c, i, _, e in rows
                if kind in "FBI"}
        for rank, rows in enumerate(replica):
            free = 0.0
            for kind, c, i, s, e in rows:
                for table, _, producer in dependencies(kind, c, i, last, m):
                    end = ends.get(("F" if table == 0 else "B", producer, i))
                    if owner[producer] != rank and end is not None and end > free:
                        out.append(s - end)
                free = e
    return out


def summarise(case: str, measured: tuple[list[Step], list[int]], cores: float) -> dict[str, Any]:
    pp, dp, _ = parse(case)
    steps, owner = measured
    parts = [sharing(s, cores) for s in steps]
    lag = [x for s in steps for x in lags(s, pp, owner)]
    q = statistics.quantiles(lag, n=4) if len(lag) > 1 else [0.0, 0.0, 0.0]
    med = {key: statistics.median(p[key] for p in parts) for key in ("span", "inside", "delivered")}
    kinds: dict[str, list[float]] = {}
    for s in steps:
        for rows in s:
            for kind, c, _, t0, t1 in rows:
                kinds.setdefault(f"{kind}{c}", []).append(t1 - t0)
    return {"case": case, "processes": pp * dp, "steps": len(steps), **{f"{k}_ms": v * 1e3 for k, v in med.items()},
            "at_k_ms": {k: statistics.median(p["at"].get(k, 0.0) for p in parts) * 1e3 for k in range(pp * dp + 1)},
            "lag_ms": {"handoffs": len(lag), "median": statistics.median(lag) * 1e3 if lag else 0.0,
                       "quartiles": [q[0] * 1e3, q[2] * 1e3]},
            "action_ms": {k: statistics.median(v) * 1e3 for k, v in sorted(kinds.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(DEFAULT), help="comma-separated, e.g. 'pp2 dp2 zbv,pp4 gpipe'")
    ap.add_argument("--steps", type=int, default=8, help="traced steps per launch")
    ap.add_argument("--rounds", type=int, default=2,
                    help="launches of each world; a case and its reference alternate (A B, B A, ...)")
    ap.add_argument("--json", action="store_true", help="JSON only")
    args = ap.parse_args()
    cores = float(os.cpu_count() or 1)
    out: list[dict[str, Any]] = []
    for case in (c.strip() for c in args.cases.split(",")):
        pp, dp, schedule = parse(case)
        t0 = time.perf_counter()
        worlds = [(case, BATCH)] + ([(f"pp{pp} {schedule}", BATCH // dp)] if dp > 1 else [])
        got: dict[str, tuple[list[Step], list[int]]] = {}
        for r in range(args.rounds):  # steps of every launch pooled: the medians are over all of them
            for name, batch_size in worlds if r % 2 == 0 else worlds[::-1]:
                steps, owner = measure(name, args.steps, batch_size)
                got[name] = (got[name][0] + steps, owner) if name in got else (steps, owner)
        row = summarise(case, got[case], cores)
        if dp > 1:  # the same schedule on one replica's processes and sequences: its work alone
            ref = row["reference"] = summarise(worlds[1][0], got[worlds[1][0]], cores)
            row["efficiency"] = dp * ref["inside_ms"] / row["delivered_ms"]
        row["seconds"] = time.perf_counter() - t0
        out.append(row)
        if not args.json:
            _print(row, cores)
    print(json.dumps(out, indent=1))


def _print(row: dict[str, Any], cores: float) -> None:
    def line(r: dict[str, Any]) -> str:
        at = ", ".join(f"{k}: {v:.0f}" for k, v in r["at_k_ms"].items() if v >= 0.5)
        lag = r["lag_ms"]
        return (f"{r['case']:<22} span {r['span_ms']:6.0f} ms  inside {r['inside_ms']:6.0f}  delivered "
                f"{r['delivered_ms']:6.0f} core-ms  ms at k ({at})  lag median {lag['median']:.2f} ms "
                f"(quartiles {lag['quartiles'][0]:.2f}, {lag['quartiles'][1]:.2f}; {lag['handoffs']} hand-offs)")

    print(line(row))
    print("  actions (median ms): " + " ".join(f"{k} {v:.1f}" for k, v in row["action_ms"].items()))
    if "reference" in row:
        ref = row["reference"]
        print("  " + line(ref))
        print("  actions (median ms): " + " ".join(f"{k} {v:.1f}" for k, v in ref["action_ms"].items()))
        print(f"  efficiency (work alone over what {cores:.0f} cores delivered): {row['efficiency']:.3f}")


if __name__ == "__main__":
    main()
