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
* ``replay``: the step's span over the span ``plait.sim.shared`` gives its schedule when every action costs
  the median, over the step's actions of its kind and chunk, of their work alone (each moment of an action
  weighted by the speed the sharing gives it then). The model's figures for the work are left out: what is
  left is whether the step takes as long as its actions, ordered by the schedule and sharing the cores as
  the model has them, say it should (its bubbles and hand-offs included). ``--profile FILE`` replays on
  the effective cores and point-to-point time ``plait train --cluster FILE`` predicts this world with; by
  default the host's cores are shared fairly and hand-offs are free.

Cases are ``pp2 dp2 1f1b``-style names; each world with ``dp > 1`` runs with its one-replica reference
(``pp2 1f1b`` at half the batch), the two launched alternately ``--rounds`` times each, since the host's
speed moves from one minute to the next; ``--steps N`` traced steps a launch (two warm-up steps dropped).
Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

MICROBATCHES = 4
SEQ = 128  # tokens a sequence
BATCH = 16  # sequences per step, over dp replicas
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


def small_config(pp: int, dp: int, schedule: str = "1f1b", batch_size: int = BATCH, steps: int = 1) -> Any:
    """``plait train``'s TrainConfig of ``small`` in a ``pp`` x ``dp`` world: the model, sequence length and
    micro-batches every pipeline benchmark here runs (``schedule``: a key of ``SCHEDULES``)."""
    from plait.parallel_config import ParallelConfig
    from plait.train.config import TrainConfig

    pc = ParallelConfig(tp=1, pp=pp, dp=dp, microbatches=MICROBATCHES, **SCHEDULES[schedule])
    return TrainConfig(parallel=pc, model="small", seq_len=SEQ, batch_size=batch_size, max_data_mb=0.5, steps=steps)


def _rank_main(steps: int, pp: int, dp: int, schedule: str, batch_size: int) -> tuple[list[Step], Any] | None:
    import torch.distributed as dist

    import plait
    from plait.train.data import batch
    from plait.train.loop import build

    cfg = small_config(pp, dp, schedule, batch_size, steps + WARMUP)
    ctx = plait.init(config=cfg.parallel)
    run = build(cfg, ctx)
    out: list[Step] = []
    for s in range(steps + WARMUP):
        dist.barrier()
        x, y = batch(run.corpus.train, s, batch_size, SEQ, run.cfg.seed, (ctx.dp_rank, ctx.dp_size))
        run.pm.train_step(x, y, trace=True)
        run.opt.step()
        stats = run.pm.last_stats
        mine = [(a.kind, a.stage, a.microbatch, stats.started_at + t0, stats.started_at + t1)
                for a, t0, t1 in stats.timeline]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, ((ctx.dp_rank, ctx.pp_rank), mine))
        if s >= WARMUP:
            out.append([rows for _, rows in sorted(every, key=lambda e: e[0])])
    return (out, run.pm.schedule) if dist.get_rank() == 0 else None


def measure(case: str, steps: int, batch_size: int = BATCH) -> tuple[list[Step], Any]:
    """Per traced step, every process's actions (``Step``), and the schedule (``plait.schedules.Schedule``)."""
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


def work_alone(step: Step, cores: float) -> dict[tuple[str, int], list[float]]:
    """Per kind and chunk, each action's work in seconds alone as ``plait.sim.shared`` counts it: its wall
    time, every moment weighted by ``min(1, cores / k)``, ``k`` the processes then inside actions."""
    events = sorted((t, d) for rows in step for *_, s, e in rows for t, d in ((s, 1), (e, -1)))
    times, speed, k = [], [], 0
    for t, d in events:
        k += d
        times.append(t)
        speed.append(min(1.0, cores / k) if k else 1.0)  # from this event to the next
    out: dict[tuple[str, int], list[float]] = {}
    for rows in step:
        for kind, c, _, s, e in rows:
            i = bisect.bisect_right(times, s) - 1
            w = 0.0
            while i < len(times) - 1 and times[i] < e:
                w += (min(e, times[i + 1]) - max(s, times[i])) * speed[i]
                i += 1
            out.setdefault((kind, c), []).append(w)
    return out


def replay(step: Step, schedule: Any, dp: int, cores: float, p2p: float) -> float:
    """The span ``plait.sim.shared`` gives ``schedule`` when every action costs the median work alone of its
    kind and chunk in this step (``work_alone``) and ``cores`` cores are time-sliced, as the planner has
    it: the dp processes of one pipeline rank compute together, so one replica's pipeline is simulated on
    ``cores / dp`` cores, and a remote input arrives ``p2p`` seconds after it was made."""
    from plait.sim.shared import simulate_shared

    work = work_alone(step, cores)
    n = schedule.num_stages
    cpu = {kind: [statistics.median(work[kind, c]) if (kind, c) in work else 0.0 for c in range(n)]
           for kind in "FBIW"}
    return simulate_shared(schedule, cpu, {kind: [0.0] * n for kind in "FBIW"}, p2p, cores / dp).makespan


def calibrated(profile: Path, case: str, batch_size: int) -> tuple[float, float]:
    """(effective cores, point-to-point seconds) of ``case``'s world as ``plait train --cluster profile``
    predicts it (``plait.plan.estimate.shared_cores``, ``plait.plan.timing``'s chunk costs)."""
    from plait.plan.config import Cluster
    from plait.plan.estimate import shared_cores
    from plait.plan.profile import HostProfile
    from plait.plan.timing import chunk_costs
    from plait.train.predict import planner_inputs

    pp, dp, schedule = parse(case)
    model, layout, training = planner_inputs(small_config(pp, dp, schedule, batch_size), pp * dp)
    cluster = Cluster.from_profile(HostProfile.load(profile), pp * dp)
    alone = chunk_costs(model, cluster, layout, training.precision)
    shared = chunk_costs(model, cluster, layout, training.precision, shared=True)
    return shared_cores(alone, shared, pp * dp), alone[0].p2p


def summarise(case: str, measured: tuple[list[Step], Any], cores: float,
              replay_at: tuple[float, float] | None = None) -> dict[str, Any]:
    """``replay_at``: (effective cores, point-to-point seconds) the replay uses; default the host's cores
    shared fairly and hand-offs free."""
    pp, dp, _ = parse(case)
    steps, schedule = measured
    owner = [schedule.stage_to_rank(c) for c in range(schedule.num_stages)]  # chunk -> pipeline rank
    parts = [sharing(s, cores) for s in steps]
    lag = [x for s in steps for x in lags(s, pp, owner)]
    at_cores, p2p = replay_at or (cores, 0.0)
    over = [p["span"] / replay(s, schedule, dp, at_cores, p2p) for s, p in zip(steps, parts, strict=True)]
    qr = statistics.quantiles(over, n=4) if len(over) > 1 else [over[0]] * 3
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
            "action_ms": {k: statistics.median(v) * 1e3 for k, v in sorted(kinds.items())},
            "replay": {"cores": at_cores, "p2p_ms": p2p * 1e3, "span_over_replay": statistics.median(over),
                       "quartiles": [qr[0], qr[2]]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(DEFAULT), help="comma-separated, e.g. 'pp2 dp2 zbv,pp4 gpipe'")
    ap.add_argument("--steps", type=int, default=8, help="traced steps per launch")
    ap.add_argument("--rounds", type=int, default=2,
                    help="launches of each world; a case and its reference alternate (A B, B A, ...)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="a calibration (plait calibrate --out FILE): replay on the effective cores and "
                         "point-to-point time plait train --cluster FILE predicts each world with (default: "
                         "the host's cores shared fairly, hand-offs free)")
    ap.add_argument("--json", action="store_true", help="JSON only")
    args = ap.parse_args()
    cores = float(os.cpu_count() or 1)
    out: list[dict[str, Any]] = []
    for case in (c.strip() for c in args.cases.split(",")):
        pp, dp, schedule = parse(case)
        t0 = time.perf_counter()
        worlds = [(case, BATCH)] + ([(f"pp{pp} {schedule}", BATCH // dp)] if dp > 1 else [])
        at = {name: calibrated(args.profile, name, b) if args.profile else None for name, b in worlds}
        got: dict[str, tuple[list[Step], Any]] = {}
        for r in range(args.rounds):  # steps of every launch pooled: the medians are over all of them
            for name, batch_size in worlds if r % 2 == 0 else worlds[::-1]:
                steps, schedule = measure(name, args.steps, batch_size)
                got[name] = (got[name][0] + steps, schedule) if name in got else (steps, schedule)
        row = summarise(case, got[case], cores, at[case])
        if dp > 1:  # the same schedule on one replica's processes and sequences: its work alone
            ref = row["reference"] = summarise(worlds[1][0], got[worlds[1][0]], cores, at[worlds[1][0]])
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

    def replayed(r: dict[str, Any]) -> str:
        x = r["replay"]
        return (f"  span over its replay on {x['cores']:.2f} cores, hand-offs {x['p2p_ms']:.2f} ms: "
                f"{x['span_over_replay']:.3f} (quartiles {x['quartiles'][0]:.3f}-{x['quartiles'][1]:.3f})")

    print(line(row))
    print("  actions (median ms): " + " ".join(f"{k} {v:.1f}" for k, v in row["action_ms"].items()))
    print(replayed(row))
    if "reference" in row:
        ref = row["reference"]
        print("  " + line(ref))
        print("  actions (median ms): " + " ".join(f"{k} {v:.1f}" for k, v in ref["action_ms"].items()))
        print(replayed(ref))
        print(f"  efficiency (work alone over what {cores:.0f} cores delivered): {row['efficiency']:.3f}")


if __name__ == "__main__":
    main()
