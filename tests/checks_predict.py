"""Rank side of the prediction test: calibrate this host inside the launch, then time plait's own training
steps under several layouts beside what the planner predicts for them (world of 4)."""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist

import plait
from harness import run_checks
from plait.train import TrainConfig
from plait.train.loop import build, train_one

# tp/pp/dp, SP, four schedules, recomputation, ZeRO-1/2: every one on the 4 processes of the launch
LAYOUTS = [
    dict(tp=2, pp=2, dp=1, schedule="1f1b"),
    dict(tp=1, pp=4, dp=1, schedule="gpipe"),
    dict(tp=4, pp=1, dp=1, sequence_parallel=True),
    dict(tp=1, pp=2, dp=2, schedule="interleaved-1f1b", virtual_stages=2),
    dict(tp=1, pp=2, dp=2, schedule="zbv"),
    dict(tp=2, pp=1, dp=2, recompute="full", zero=2),
    dict(tp=1, pp=1, dp=4, zero=1),
]
ROUNDS, STEPS = 2, 2  # timed steps per layout per round; the rounds alternate over the layouts
TRIALS = 3  # at most: calibrations of 4 processes, each followed by ROUNDS rounds of the layouts' steps


def _cfg(root: Path, **kw) -> TrainConfig:
    base = dict(model="tiny", microbatches=4, seq_len=128, batch_size=16, steps=1 + TRIALS * ROUNDS * STEPS,
                eval_every=0, sample_tokens=0, trace_every=0, max_data_mb=0.3, checkpoint_dir=str(root / "ck"),
                cluster="none")
    return TrainConfig.from_dict({**base, **kw})


def _time(run, first: int) -> list[float]:
    times = []
    for step in range(first, first + STEPS):
        dist.barrier()
        t0 = time.perf_counter()
        train_one(run, step, False)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times


def check_calibration(root: Path, box: dict) -> dict:
    """A quick calibration of 1, 2 and 4 processes in this launch (kept in ``box`` for the prediction check):
    its progress ticks, each section's thread count, the one process's figures (alone and shared the same),
    the matmul figures of 2 and 4 processes alone and shared, their optimizer figures and every section's
    pipeline and its twin; and, from every rank, the kernels it warmed up (every kernel a process measures,
    alone or shared, starts with one) with the thread count torch ran them at, in order."""
    from plait.calibrate import host_facts
    from plait.calibrate import kernels as k
    from plait.calibrate.run import measure_in_world, total_steps

    plait.init(1, 1, 4).close()  # the default process group (which stays), the one the calibration measures in
    ticks = root / "calibration-ticks"
    warm_up, warmed = k.warm_up, []

    def watched(kernel, device, rounds=2):
        warmed.append((kernel.label, torch.get_num_threads()))
        return warm_up(kernel, device, rounds)

    k.warm_up = watched  # type: ignore[assignment]
    try:
        box["profile"] = profile = measure_in_world([1, 2, 4], str(ticks), host_facts(), quick=True)
    finally:
        k.warm_up = warm_up
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, warmed)
    if dist.get_rank() != 0:
        return {}
    assert profile is not None
    one, two, four = profile.section(1), profile.section(2), profile.section(4)
    return {"ticks": len(ticks.read_text().splitlines()), "total_steps": total_steps([1, 2, 4], quick=True),
            "threads": [one.threads, two.threads, four.threads], "warmed": everyone,
            "one": {kind: [list(r.alone), list(r.shared)] for kind, r in one.rates.items()},
            "matmul": [[list(s.rates["matmul"].alone), list(s.rates["matmul"].shared)] for s in (two, four)],
            "slowdown": [two.rates["matmul"].slowdown, four.rates["matmul"].slowdown],
            "optimizer": [[s.optimizer_s_per_param, s.optimizer_s_per_tensor] for s in (two, four)],
            "pipeline": [[s.pipeline_s, s.pipeline_twin_s] for s in (one, two, four)]}


#: how far each layout's measured/predicted ratio may sit from the layouts' median: a TP layout's collectives each
#: wait for both ranks to hold a core, so when other jobs load the cores more during the steps than during the
#: calibration its ratio rises against the others (three trials of one launch read the TP layouts at 2.0-2.3x the
#: median at load averages of 14 to 21, the others within 1.3x of it)
SPREAD = 2.5


def off_bounds(rows: list[dict]) -> str | None:
    """What puts the layouts' measured/predicted ratios out of the prediction check's bounds (their median
    within 2x either way, each within ``SPREAD`` of that median), or None when they are in."""
    ratios = {str(r["layout"]): r["measured_s"] / r["predicted_s"] for r in rows}
    middle = statistics.median(ratios.values())
    if not 0.5 <= middle <= 2.0:
        return f"median measured/predicted {middle:.2f}: {ratios}"
    off = [f"{name}: {ratio:.2f} ({ratio / middle:.2f}x)" for name, ratio in ratios.items()
           if not 1 / SPREAD <= ratio / middle <= SPREAD]
    return f"measured/predicted against their median {middle:.2f}: {'; '.join(off)}" if off else None


def check_predicted_vs_measured(root: Path, profile) -> dict:
    """Every layout built once (one warm-up step each), then timed in rounds that alternate over them: a
    burst of another job's load lands on one round of a layout, rarely on both; the fastest step counts
    (nothing makes a step faster than the machine allows). Each layout's prediction is the fastest of the
    trials' calibrations (a burst slows a calibration's figures as it slows a step; the first trial's is
    ``check_calibration``'s): a trial whose ratios are out of ``off_bounds`` is followed by another, a quick
    calibration of 4 processes and its rounds, up to ``TRIALS``, every step and calibration so far counting.
    Returns the rows of the last trial and each trial's verdict (``off_bounds``)."""
    from plait.calibrate import host_facts
    from plait.calibrate.run import measure_in_world
    from plait.cli.predict import memory_rows, predict

    runs = []
    verdicts: list[str | None] = []
    rows: list[dict] = []
    with ExitStack() as contexts:
        for kw in LAYOUTS:
            cfg = _cfg(root, **kw)
            par = cfg.parallel
            run = build(cfg, contexts.enter_context(plait.init(par.tp, par.pp, par.dp)))
            train_one(run, 0, False)  # the first step also measures the bytes per rank
            memory = [None] * dist.get_world_size()
            dist.all_gather_object(memory, {"pp": run.ctx.pp_rank, **run.pm.memory_report()})
            runs.append((kw, cfg, run, [], memory, []))
        step = 1
        for trial in range(TRIALS):
            if trial:
                profile = measure_in_world([4], None, host_facts(), quick=True)
            for _r in range(ROUNDS):
                for _kw, _c, run, times, _m, _p in runs:
                    times += _time(run, step)
                step += STEPS
            verdict = [None]
            if dist.get_rank() == 0:
                rows = []
                for kw, cfg, _run, times, memory, predicted in runs:
                    est = predict(cfg, profile, 4)
                    predicted.append(est.step_time_s)
                    rows.append({"layout": kw, "measured_s": min(times), "steps_s": list(times),
                                 "predicted_s": min(predicted), "predicted_trials_s": list(predicted),
                                 "predicted_bubble": est.bubble_fraction, "memory": memory,
                                 "predicted_memory": memory_rows(est)})
                verdict = [off_bounds(rows)]
            dist.broadcast_object_list(verdict, src=0)
            verdicts.append(verdict[0])
            if verdict[0] is None:
                break
    return {"rows": rows, "trials": verdicts} if dist.get_rank() == 0 else {}


# an MoE preset at tp2·dp2 with ZeRO-1, its experts in both placements (plan.experts): whole with EP over the TP
# group (expert-DP 2) and over the stage's four ranks (expert-DP 1), split over TP with EP over dp (expert-DP 1);
# and whole over the TP group under sequence parallelism
MOE_LAYOUTS = [dict(tp=2, pp=1, dp=2, ep=2), dict(tp=2, pp=1, dp=2, ep=4), dict(tp=2, pp=1, dp=2, ep=2, expert_tp=True),
               dict(tp=2, pp=1, dp=2, ep=2, sequence_parallel=True)]


def balanced_route(route):
    """``route`` with every expert given the same share of each run of E/k consecutive tokens: token i of the
    flattened [B, S] goes to experts (i·k + j) mod E, j < k (its router logits raised by 30 there), so every
    rank's slice of the tokens sends each expert the same number of rows. The router, top-k and gates run as
    ever, so the layer saves what it saves under any routing, at the sizes of balanced routing."""
    def balanced(logits, top_k, *args):
        b, s, e = logits.shape
        token = torch.arange(b * s, device=logits.device).view(b, s, 1)
        pick = (token * top_k + torch.arange(top_k, device=logits.device)) % e
        return route(logits + torch.zeros_like(logits).scatter_(-1, pick, 30.0), top_k, *args)

    return balanced


def check_moe_memory(root: Path) -> list[dict]:
    """Bytes per rank of one step of each ``MOE_LAYOUTS`` run of ``tiny`` with 4 experts, top-2
    (``pm.memory_report()``), every rank's, beside its ``plait train`` configuration; with the routing
    ``balanced_route`` forces."""
    from plait.experts import layer

    out = []
    route = layer.route
    layer.route = balanced_route(route)  # type: ignore[assignment]
    try:
        for i, kw in enumerate(MOE_LAYOUTS):
            cfg = _cfg(root / f"moe{i}", experts=4, top_k=2, zero=1, microbatches=2, steps=1, **kw)
            with plait.init(config=cfg.parallel) as ctx:
                run = build(cfg, ctx)
                train_one(run, 0, False)
                memory = [None] * dist.get_world_size()
                dist.all_gather_object(memory, run.pm.memory_report())
            out.append({"layout": kw, "config": cfg.to_dict(), "memory": memory})
    finally:
        layer.route = route
    return out


LATE_S = 0.5  # the least the last DP replica starts its forward/backward late in the phases check


def check_phases(root: Path) -> dict:
    """Four DP replicas, the last starting its forward/backward late: this rank's seconds per phase of the
    step (``train_one(..., phases)``) beside the step's own time, and the delay. The others should wait for it
    in the gradient reduction, the late one in its forward/backward. The delay is at least ``LATE_S`` and
    twice the slowest rank's plain step timed just before: the other replicas compute while the late one
    sleeps, and other jobs on the cores can stretch their forward/backward past the late one's own by a fixed
    delay's half (0.58 s at load 8; with 0.5 s, 2 of 4 launches at load 10 left less than half of it to their
    gradient reduction)."""
    cfg = _cfg(root / "phases", tp=1, pp=1, dp=4)
    with plait.init(1, 1, 4) as ctx:
        run = build(cfg, ctx)
        train_one(run, 0, False)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        train_one(run, 1, False)
        plain = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(plain, op=dist.ReduceOp.MAX)
        delay = max(LATE_S, 2 * float(plain))
        if run.ctx.dp_rank == 3:
            run_schedule = run.pm.executor.run

            def late(*args, **kwargs):
                time.sleep(delay)
                return run_schedule(*args, **kwargs)

            run.pm.executor.run = late  # this rank's model is thrown away after the check
        phases: dict[str, float] = {}
        dist.barrier()
        t0 = time.perf_counter()
        train_one(run, 2, False, phases)
        step_s = time.perf_counter() - t0
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"dp": run.ctx.dp_rank, "phases": phases, "step_s": step_s})
        return {"ranks": everyone, "late_s": delay}


def rank_main(root: str) -> dict:
    root = Path(root)
    box: dict = {}
    return run_checks([("calibrate/sections", lambda: check_calibration(root, box)),
                       ("predict/vs_measured", lambda: check_predicted_vs_measured(root, box.get("profile"))),
                       ("predict/phases", lambda: check_phases(root)),
                       ("predict/moe_memory", lambda: check_moe_memory(root))])  # last: after the timed checks


def paired_sleeps() -> tuple[int, tuple, tuple, list[float]]:
    """Rank side of the pairing test: one kernel timed by the calibration's alone-and-shared pairs over 2 ranks,
    its call a sleep of 4 ms on rank 0 and 12 ms on rank 1 that reports a part of 1 ms. Returns (calls
    made, the figure alone, the figure shared, each call's seconds as it timed itself): the figure is (call
    seconds, part seconds)."""
    from plait.calibrate import kernels as k
    from plait.calibrate.run import paired

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    took: list[float] = []

    def call() -> dict[str, float]:
        t0 = time.perf_counter()
        time.sleep(0.004 if rank == 0 else 0.012)
        took.append(time.perf_counter() - t0)
        return {"part": 0.001}

    kernel = k.Kernel("sleep", {"call": call}, lambda r, pick: (pick([x["call"] for x in r]),
                                                               pick([x["part"] for x in r])), budget=0.05)
    alone, shared = paired(torch.device("cpu"), dist.group.WORLD)(kernel)
    dist.destroy_process_group()
    return len(took), alone, shared, took


def tp_round_calls(calls: int) -> tuple[list[int], float, float, list[float]]:
    """Rank side of the round-length test: ``tp_block.measure`` over a 2-rank group with ``calls`` calls of
    each part per round, its parts replaced by sleeps that count their calls and time themselves (layer 8 ms,
    twin 2 ms). Returns (calls of the layer and of the twin, their mean seconds as measured, each part's mean
    seconds a call after the warm-up as it timed itself)."""
    from plait.calibrate import tp_block

    dist.init_process_group("gloo")
    counts = [0, 0]
    took: list[list[float]] = [[], []]

    def sleeper(i: int, seconds: float):
        def part() -> None:
            counts[i] += 1
            t0 = time.perf_counter()
            time.sleep(seconds)
            took[i].append(time.perf_counter() - t0)
        return part

    def parts(shape, group, sp, device, dtype):
        return sleeper(0, 0.008), sleeper(1, 0.002)

    tp_block._parts = parts  # the rank's process is thrown away after the check
    groups = [dist.new_group([0, 1])]
    layer_s, twin_s = tp_block.measure((1, 8, 32, 2, 2), 2, 2, False, groups, dist.group.WORLD,
                                       torch.device("cpu"), budget=0.1, calls=calls)
    dist.destroy_process_group()
    return counts, layer_s, twin_s, [statistics.fmean(t[1:]) for t in took]
