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
* ``alone``: after every traced step, each process in turn runs its own actions of that step in the same
  order, with no other process computing (the rest wait in a barrier, which costs no CPU), by hand on the
  chunks: a forward (and the loss on the last chunk), a backward from a random output gradient, or its
  input (I) and weight (W) halves. That is each action's work alone at its own place in the step, measured
  rather than read through a sharing curve. An action's time alone over its time in the step, binned by
  ``k`` (the time-weighted number of processes inside actions meanwhile, itself included), is the sharing
  curve as pipeline steps meet it; the span over ``plait.sim.shared`` with the median alone work of each
  kind and chunk, and the cores at which that simulation gives the span (``cores_in_step``), test the
  model's sharing and its effective cores together with the bubbles. With ``--profile``, the model's work
  alone (``plait.plan.timing.chunk_costs``) over the measured, per kind: the host's drift since the
  calibration moves every kind alike, so the differences between kinds are the model's.

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
from collections.abc import Callable
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
Alone = list[list[float]]  # per process as in Step, the seconds of each of its actions run alone, in order


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


def _alone(run: Any, ctx: Any, rows: list[Row], inputs: Any, targets: Any) -> list[float]:
    """Seconds of each of ``rows``' actions run by hand, in order, on this rank's chunks: F (the loss on the
    last chunk, as the run computes it), B from a random output gradient, I under the weight-gradient store,
    W its flush. A later chunk's input is random, of the activation's shape. Gradients are cleared after."""
    import time as clock

    import torch

    from plait.parallelization import TokenLoss

    pm = run.pm
    last = pm.schedule.num_stages - 1
    loss = TokenLoss(ctx, pm.vocab_size)
    width = int(pm.model_config.dim)
    saved: dict[tuple[int, int], Any] = {}
    out: list[float] = []

    def actions() -> None:
        for kind, c, mb, _, _ in rows:
            t0 = clock.perf_counter()
            if kind == "F":
                x = inputs[mb] if c == 0 else torch.randn(inputs[mb].shape[0], SEQ, width, requires_grad=True)
                y = pm.chunks[c](x)
                saved[c, mb] = loss(y, targets[mb]) if c == last else y
            elif kind == "W":
                pm.store.flush((c, mb))
                del saved[c, mb]
            else:
                y = saved[c, mb] if kind == "I" else saved.pop((c, mb))
                grad = None if c == last else torch.randn_like(y)
                if kind == "I":
                    with pm.store.deferring((c, mb)):
                        torch.autograd.backward(y, grad)
                else:
                    torch.autograd.backward(y, grad)
            out.append(clock.perf_counter() - t0)

    pm.cast.run(actions)
    pm.zero_grad()
    return out


def _rank_main(steps: int, pp: int, dp: int, schedule: str, batch_size: int,
               alone: bool) -> tuple[list[Step], Any, list[Alone]] | None:
    import torch.distributed as dist

    import plait
    from plait.train.data import batch
    from plait.train.loop import build

    cfg = small_config(pp, dp, schedule, batch_size, steps + WARMUP)
    ctx = plait.init(config=cfg.parallel)
    run = build(cfg, ctx)
    out: list[Step] = []
    solo: list[Alone] = []
    me = (ctx.dp_rank, ctx.pp_rank)
    for s in range(steps + WARMUP):
        dist.barrier()
        x, y = batch(run.corpus.train, s, batch_size, SEQ, run.cfg.seed, (ctx.dp_rank, ctx.dp_size))
        run.pm.train_step(x, y, trace=True)
        run.opt.step()
        stats = run.pm.last_stats
        mine = [(a.kind, a.stage, a.microbatch, stats.started_at + t0, stats.started_at + t1)
                for a, t0, t1 in stats.timeline]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (me, mine))
        if s < WARMUP:
            continue
        out.append([rows for _, rows in sorted(every, key=lambda e: e[0])])
        if alone:  # every process in turn, the others waiting
            times: list[float] = []
            for turn in range(dist.get_world_size()):
                dist.barrier()
                if turn == dist.get_rank():
                    times = _alone(run, ctx, mine, x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))
            dist.all_gather_object(every, (me, times))
            solo.append([t for _, t in sorted(every, key=lambda e: e[0])])
    return (out, run.pm.schedule, solo) if dist.get_rank() == 0 else None


def measure(case: str, steps: int, batch_size: int = BATCH,
            alone: bool = False) -> tuple[list[Step], Any, list[Alone]]:
    """Per traced step, every process's actions (``Step``); the schedule (``plait.schedules.Schedule``); with
    ``alone``, per traced step every process's actions run alone after it (``Alone``; else empty)."""
    from plait.distributed.launch import run_world

    pp, dp, schedule = parse(case)
    results = run_world(_rank_main, pp * dp, steps, pp, dp, schedule, batch_size, alone, timeout_s=1800)
    return next(r for r in results if r is not None)


def occupancy(step: Step) -> tuple[list[float], list[int]]:
    """The step's action starts and ends in time order, and the processes inside actions from each to the
    next."""
    events = sorted((t, d) for rows in step for *_, s, e in rows for t, d in ((s, 1), (e, -1)))
    times, ks, k = [], [], 0
    for t, d in events:
        k += d
        times.append(t)
        ks.append(k)
    return times, ks


def integral(times: list[float], values: list[float], s: float, e: float) -> float:
    """The integral over [s, e] of the step function ``values[i]`` from ``times[i]`` to ``times[i + 1]``."""
    i = max(0, bisect.bisect_right(times, s) - 1)
    total = 0.0
    while i < len(times) - 1 and times[i] < e:
        total += (min(e, times[i + 1]) - max(s, times[i])) * values[i]
        i += 1
    return total


def sharing(step: Step, cores: float) -> dict[str, Any]:
    """Span, inside, delivered (seconds) and the seconds at each k of one step's actions on every process."""
    times, ks = occupancy(step)
    at: dict[int, float] = {0: 0.0}
    for i in range(len(times) - 1):
        at[ks[i]] = at.get(ks[i], 0.0) + times[i + 1] - times[i]
    inside = sum(e - s for rows in step for *_, s, e in rows)
    return {"span": times[-1] - times[0], "inside": inside,
            "delivered": integral(times, [min(k, cores) for k in ks], times[0], times[-1]), "at": at}


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
    times, ks = occupancy(step)
    speed = [min(1.0, cores / k) if k else 1.0 for k in ks]
    out: dict[tuple[str, int], list[float]] = {}
    for rows in step:
        for kind, c, _, s, e in rows:
            out.setdefault((kind, c), []).append(integral(times, speed, s, e))
    return out


def measured_alone(step: Step, times: Alone) -> dict[tuple[str, int], list[float]]:
    """Per kind and chunk, the seconds of the step's actions run alone (``Alone``, aligned with ``step``)."""
    out: dict[tuple[str, int], list[float]] = {}
    for rows, secs in zip(step, times, strict=True):
        for (kind, c, *_), t in zip(rows, secs, strict=True):
            out.setdefault((kind, c), []).append(t)
    return out


def inside_k(step: Step) -> Callable[[float, float], float]:
    """A function (start, end) -> the time-weighted mean number of processes inside actions meanwhile."""
    times, ks = occupancy(step)
    counts = [float(k) for k in ks]
    return lambda s, e: integral(times, counts, s, e) / (e - s)


def speed_by_k(steps: list[Step], solo: list[Alone], near: float = 0.1) -> dict[int, tuple[float, int]]:
    """By the processes inside actions meanwhile (their mean within ``near`` of a whole number; the rest are
    left out): (the actions' seconds alone over their seconds in the step, summed over the actions; how many
    actions). A sum, not a median: at ``k`` above the cores the scheduler does not share evenly over one
    action, so single actions run anywhere from about ``cores / k`` to full speed."""
    sums: dict[int, list[float]] = {}
    for step, times in zip(steps, solo, strict=True):
        mean = inside_k(step)
        for rows, secs in zip(step, times, strict=True):
            for (*_, s, e), t in zip(rows, secs, strict=True):
                k = mean(s, e)
                if abs(k - round(k)) < near:
                    acc = sums.setdefault(round(k), [0.0, 0.0, 0])
                    acc[0] += t
                    acc[1] += e - s
                    acc[2] += 1
    return {k: (a / b, int(n)) for k, (a, b, n) in sorted(sums.items())}


def cores_in_step(step: Step, times: Alone, schedule: Any, dp: int, most: float) -> float:
    """The effective cores at which ``replay`` of the step's work alone as measured gives its span, between
    0.25 and ``most`` (``most`` if even that replays longer; past the processes more cores change nothing)."""
    span = sharing(step, most)["span"]
    work = measured_alone(step, times)
    lo, hi = 0.25, most
    if replay(step, schedule, dp, hi, 0.0, work) > span:
        return most
    for _ in range(30):  # the replay shortens as the cores grow
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if replay(step, schedule, dp, mid, 0.0, work) > span else (lo, mid)
    return (lo + hi) / 2


def replay(step: Step, schedule: Any, dp: int, cores: float, p2p: float,
           work: dict[tuple[str, int], list[float]] | None = None) -> float:
    """The span ``plait.sim.shared`` gives ``schedule`` when every action costs the median work alone of its
    kind and chunk in this step (``work``, default ``work_alone``: read through the sharing) and ``cores``
    cores are time-sliced, as the planner has it: the dp processes of one pipeline rank compute together,
    so one replica's pipeline is simulated on ``cores / dp`` cores, and a remote input arrives ``p2p``
    seconds after it was made."""
    from plait.sim.shared import simulate_shared

    work = work_alone(step, cores) if work is None else work
    n = schedule.num_stages
    cpu = {kind: [statistics.median(work[kind, c]) if (kind, c) in work else 0.0 for c in range(n)]
           for kind in "FBIW"}
    return simulate_shared(schedule, cpu, {kind: [0.0] * n for kind in "FBIW"}, p2p, cores / dp).makespan


def calibrated(profile: Path, case: str, batch_size: int) -> tuple[float, float, dict[str, list[float]]]:
    """(effective cores, point-to-point seconds, work alone per action kind and chunk) of ``case``'s world as
    ``plait train --cluster profile`` predicts it (``plait.plan.host.sharing``'s ``shared_cores`` and
    ``action_costs``, ``plait.plan.timing``'s chunk costs)."""
    from plait.plan.host.costs import HostCosts
    from plait.plan.host.profile import HostProfile
    from plait.plan.host.sharing import action_costs, shared_cores
    from plait.plan.pipeline import SPLIT_BACKWARD
    from plait.plan.timing import chunk_costs
    from plait.train.predict import planner_inputs

    pp, dp, schedule = parse(case)
    model, layout, training = planner_inputs(small_config(pp, dp, schedule, batch_size), pp * dp)
    costs = HostCosts(HostProfile.load(profile), pp * dp)
    alone = chunk_costs(costs, model, layout, training.precision)
    shared = chunk_costs(costs.shared_twin(), model, layout, training.precision)
    work, _ = action_costs(alone, layout.schedule in SPLIT_BACKWARD)
    return shared_cores(alone, shared, pp * dp, costs.cores), alone[0].p2p, work


def summarise(case: str, measured: tuple[list[Step], Any, list[Alone]], cores: float,
              replay_at: tuple[float, float, dict[str, list[float]]] | None = None) -> dict[str, Any]:
    """``replay_at``: (effective cores, point-to-point seconds, the model's work alone) the replay uses and
    the work alone is compared with (``calibrated``); default the host's cores shared fairly and hand-offs
    free."""
    pp, dp, _ = parse(case)
    steps, schedule, solo = measured
    owner = [schedule.stage_to_rank(c) for c in range(schedule.num_stages)]  # chunk -> pipeline rank
    parts = [sharing(s, cores) for s in steps]
    lag = [x for s in steps for x in lags(s, pp, owner)]
    at_cores, p2p, _ = replay_at or (cores, 0.0, None)
    over = [p["span"] / replay(s, schedule, dp, at_cores, p2p) for s, p in zip(steps, parts, strict=True)]
    q = statistics.quantiles(lag, n=4) if len(lag) > 1 else [0.0, 0.0, 0.0]
    med = {key: statistics.median(p[key] for p in parts) for key in ("span", "inside", "delivered")}
    kinds: dict[str, list[float]] = {}
    for s in steps:
        for rows in s:
            for kind, c, _, t0, t1 in rows:
                kinds.setdefault(f"{kind}{c}", []).append(t1 - t0)
    row = {"case": case, "processes": pp * dp, "steps": len(steps), **{f"{k}_ms": v * 1e3 for k, v in med.items()},
           "at_k_ms": {k: statistics.median(p["at"].get(k, 0.0) for p in parts) * 1e3 for k in range(pp * dp + 1)},
           "lag_ms": {"handoffs": len(lag), "median": statistics.median(lag) * 1e3 if lag else 0.0,
                      "quartiles": [q[0] * 1e3, q[2] * 1e3]},
           "action_ms": {k: statistics.median(v) * 1e3 for k, v in sorted(kinds.items())},
           "replay": {"cores": at_cores, "p2p_ms": p2p * 1e3, **_middle(over, "span_over_replay")}}
    if solo:
        row["alone"] = _alone_summary(steps, solo, schedule, dp, cores, replay_at)
    return row


def _middle(values: list[float], name: str) -> dict[str, Any]:
    """``{name: median, "quartiles": [first, third]}``."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {name: statistics.median(values), "quartiles": [q[0], q[2]]}


def _alone_summary(steps: list[Step], solo: list[Alone], schedule: Any, dp: int, cores: float,
                   replay_at: tuple[float, float, dict[str, list[float]]] | None) -> dict[str, Any]:
    """The ``alone`` part of a world's row (see the module's docstring)."""
    works = [measured_alone(s, t) for s, t in zip(steps, solo, strict=True)]
    spans = [sharing(s, cores)["span"] for s in steps]
    fair = [span / replay(s, schedule, dp, cores, 0.0, w) for s, w, span in zip(steps, works, spans, strict=True)]
    out: dict[str, Any] = {
        "work_ms": statistics.median(sum(map(sum, t)) for t in solo) * 1e3,
        "speed_by_k": {k: {"speed": v, "actions": n} for k, (v, n) in speed_by_k(steps, solo).items()},
        "fair": _middle(fair, "span_over_replay"),
        "cores_in_step": _middle([cores_in_step(s, t, schedule, dp, len(s))
                                  for s, t in zip(steps, solo, strict=True)], "cores")}
    if replay_at is not None:
        at_cores, p2p, model = replay_at
        out["profile"] = _middle([span / replay(s, schedule, dp, at_cores, p2p, w)
                                  for s, w, span in zip(steps, works, spans, strict=True)], "span_over_replay")
        ratio: dict[str, list[float]] = {}  # per kind, the model's work over the measured, every chunk's sum
        for w in works:
            for kind in sorted({k for k, _ in w}):
                chunks = [c for k, c in w if k == kind]
                ratio.setdefault(kind, []).append(sum(model[kind][c] for c in chunks)
                                                  / sum(statistics.median(w[kind, c]) for c in chunks))
        out["model_over_alone"] = {kind: statistics.median(v) for kind, v in ratio.items()}
    return out


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
    ap.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True,
                    help="after every traced step, run each process's actions of it alone, in turn (about "
                         "doubles the time)")
    ap.add_argument("--json", action="store_true", help="JSON only")
    args = ap.parse_args()
    cores = float(os.cpu_count() or 1)
    out: list[dict[str, Any]] = []
    for case in (c.strip() for c in args.cases.split(",")):
        pp, dp, schedule = parse(case)
        t0 = time.perf_counter()
        worlds = [(case, BATCH)] + ([(f"pp{pp} {schedule}", BATCH // dp)] if dp > 1 else [])
        at = {name: calibrated(args.profile, name, b) if args.profile else None for name, b in worlds}
        got: dict[str, tuple[list[Step], Any, list[Alone]]] = {}
        for r in range(args.rounds):  # steps of every launch pooled: the medians are over all of them
            for name, batch_size in worlds if r % 2 == 0 else worlds[::-1]:
                steps, schedule, solo = measure(name, args.steps, batch_size, args.alone)
                before = got.get(name, ([], schedule, []))
                got[name] = (before[0] + steps, schedule, before[2] + solo)
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

    def alone(r: dict[str, Any]) -> list[str]:
        if "alone" not in r:
            return []
        a = r["alone"]
        by_k = ", ".join(f"{k}: {v['speed']:.3f} ({v['actions']})" for k, v in a["speed_by_k"].items())
        out = [f"  work alone {a['work_ms']:.0f} ms; the actions' speed in the step, by k computing "
               f"(their time alone over in the step; actions): {by_k}",
               f"  span over its work alone replayed on {cores:.0f} fair cores: {a['fair']['span_over_replay']:.3f}; "
               f"cores that replay to the span: {a['cores_in_step']['cores']:.2f} "
               f"(quartiles {a['cores_in_step']['quartiles'][0]:.2f}-{a['cores_in_step']['quartiles'][1]:.2f})"]
        if "profile" in a:
            kinds = " ".join(f"{k} {v:.3f}" for k, v in a["model_over_alone"].items())
            out.append(f"  on the profile's {r['replay']['cores']:.2f} cores: {a['profile']['span_over_replay']:.3f}; "
                       f"the model's work over the work alone: {kinds}")
        return out

    print(line(row))
    print("  actions (median ms): " + " ".join(f"{k} {v:.1f}" for k, v in row["action_ms"].items()))
    print(replayed(row))
    print("\n".join(alone(row)))
    if "reference" in row:
        ref = row["reference"]
        print("  " + line(ref))
        print("  actions (median ms): " + " ".join(f"{k} {v:.1f}" for k, v in ref["action_ms"].items()))
        print(replayed(ref))
        print("\n".join("  " + x for x in alone(ref)))
        print(f"  efficiency (work alone over what {cores:.0f} cores delivered): {row['efficiency']:.3f}")


if __name__ == "__main__":
    main()
