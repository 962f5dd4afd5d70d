"""Benchmark: the planner's predictions against plait's own training runs on this machine.

``plait calibrate`` measures the host, then ``plait train`` runs each layout (tp, pp, dp, SP; gpipe, 1f1b,
interleaved, zbv; recompute none/selective/full; ZeRO-1/2) with ``--cluster`` set to that profile: every
step's metrics row carries the measured and predicted step time and bubble, and the first row the predicted and measured
bytes per rank (measured on the first step). The rounds alternate (every layout once, then again, the second
round in the reverse order) so that a change of the machine's speed, even one that goes on over the whole
run, touches every layout alike; the median of the steady steps of both rounds is compared. How far apart
a layout's rounds were (the ``apart`` column, each round the median of its steady steps) is the runs' own
noise, beside the prediction's error.
Goal: every step time within 15% and every memory figure within 10% of the prediction.
Before every run it takes the calibration's speed probe (one thread, one linear layer) in this process: the
speed now over the calibration's mean is the ``host speed`` column. This machine's speed moves by up to a
quarter between minutes (more on a busy day), and a prediction can only be as right as the speed it was
calibrated at. The probe is a short one, and noisier than what it probes (docs/planner-log.md, entry 4, measured
how much: (on this VM, readings 12-17% apart from one second to the next, correlated 0.1-0.4 with the speed
of the work after them), so a single ``host speed`` says little; many of them over a benchmark say whether
the host was slower or faster on the whole.
``at speed`` is the ratio times the host speed: what it would be had the calibration run at the speed the
host had before that run. It was meant to separate the model's error from the host's drift; with a probe
this noisy it mostly adds the probe's noise (it came out below the plain ratio in the runs measured), so it
is a diagnostic, and the goal is judged on the ratio itself.
``--interleave`` calibrates again between the rounds and after the last and predicts every layout with the
mean of those calibrations (``plait train --dry-run``): the calibrations then meet the host over the same
minutes as the runs, as the rounds meet it alike. The prediction of the first calibration alone (made
before any run) is shown beside it, with its own verdict; and, as a diagnostic, each round against the mean
of the two calibrations either side of it (the host's drift over the whole run then reaches neither).
Each calibration is kept on its own (beside ``--profile`` as STEM.1.toml, STEM.2.toml, ...).
The ratios' geometric mean per process count is printed too: each count is predicted from its own
section of the calibration, so a count apart from the others points at that section. What one feature
costs, free of the host's drift, was measured two layouts to a world (docs/planner-log.md, entry 6).
A second table splits each step into the phases ``plait train`` measures on rank 0 (forward-backward,
gradient reduction, optimizer; ``plait.plan.estimate.PHASES``) beside the first calibration's prediction of
each, so that a miss shows where in the step it is.
Prints a table and JSON. ``--quick``: fewer layouts, one round (a smoke run); ``--rounds N``, ``--steps N``;
``--profile FILE`` keeps the calibration (or reuses one), ``--layouts a,b`` picks layouts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from plait.plan.estimate import PHASES
from plait.train.report import median_phases

PLAIT = [sys.executable, "-m", "plait.cli.main"]
COMMON = ["--model", "small", "--seq-len", "128", "--batch-size", "16", "--microbatches", "4", "--eval-every", "0",
          "--sample-tokens", "0", "--max-data-mb", "0.5", "--trace-every", "3"]
LAYOUTS = {
    "single": ["--tp", "1", "--pp", "1"],
    "tp2": ["--tp", "2", "--pp", "1"],
    "dp2": ["--tp", "1", "--pp", "1", "--dp", "2"],
    "pp2 1f1b": ["--tp", "1", "--pp", "2"],
    "tp2 pp2 1f1b": ["--tp", "2", "--pp", "2"],
    "tp2 dp2 sp": ["--tp", "2", "--pp", "1", "--dp", "2", "--sequence-parallel"],
    "pp4 gpipe": ["--tp", "1", "--pp", "4", "--schedule", "gpipe"],
    "pp2 dp2 interleaved v2": ["--tp", "1", "--pp", "2", "--dp", "2", "--schedule", "interleaved-1f1b",
                               "--virtual-stages", "2"],
    "pp2 dp2 zbv": ["--tp", "1", "--pp", "2", "--dp", "2", "--schedule", "zbv"],
    "tp2 pp2 recompute": ["--tp", "2", "--pp", "2", "--recompute", "full"],
    "tp4 sp": ["--tp", "4", "--pp", "1", "--sequence-parallel"],
    "pp2 dp2 zero2": ["--tp", "1", "--pp", "2", "--dp", "2", "--zero", "2"],
    "tp2 dp2 selective zero1": ["--tp", "2", "--pp", "1", "--dp", "2", "--recompute", "selective", "--zero", "1"],
}
QUICK = ("single", "tp2 pp2 1f1b", "pp2 dp2 zbv")
STEPS = 12
GOAL_TIME, GOAL_MEMORY = 0.15, 0.10
KINDS = ("params", "grads", "optimizer", "activations_peak")


def load() -> str:
    return Path("/proc/loadavg").read_text().split(" ")[0] if Path("/proc/loadavg").exists() else "?"


def probe() -> float:
    """The host's speed now: the calibration's probe (``plait.calibrate.kernels.reference_rate``, FLOP/s),
    as ``plait train`` takes it at its start; over the profile's mean speed it is the ``host speed``."""
    import torch

    from plait.calibrate.kernels import reference_rate

    return reference_rate(torch.device("cpu"))


def calibrate(out: Path, add: bool = False) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(PLAIT + ["calibrate", "--out", str(out)] + (["--add"] if add else []),
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"plait calibrate failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - t0


def predict(name: str, profile: Path, work: Path) -> float:
    """Step time (s) ``plait train --dry-run`` predicts for layout ``name`` on ``profile``."""
    metrics = work / f"{name.replace(' ', '_')}-dry.jsonl"
    metrics.unlink(missing_ok=True)
    args = PLAIT + ["train", *COMMON, *LAYOUTS[name], "--cluster", str(profile), "--metrics", str(metrics),
                    "--dry-run"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=work)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: plait train --dry-run failed:\n{done.stderr[-2000:]}")
    return float(json.loads(metrics.read_text().splitlines()[-1])["predicted_step_time_s"])


def run(name: str, profile: Path, work: Path, steps: int) -> list[dict]:
    """The metrics rows of one ``plait train`` of layout ``name``."""
    metrics = work / f"{name.replace(' ', '_')}.jsonl"
    args = PLAIT + ["train", *COMMON, *LAYOUTS[name], "--steps", str(steps), "--cluster", str(profile),
                    "--metrics", str(metrics), "--checkpoint-dir", str(work / "ck" / name.replace(" ", "_"))]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=work)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: plait train failed:\n{done.stderr[-2000:]}")
    return [json.loads(ln) for ln in metrics.read_text().splitlines()]


def memory_errors(rows: list[dict]) -> list[tuple[str, float, float]]:
    """(what, predicted, measured) for each kind on each pipeline rank (its most loaded process), from the
    metrics row that carries them (the first step's)."""
    mem = next((r["memory"] for r in rows if "memory" in r), {})
    out = []
    for pred in mem.get("predicted", []):
        ranks = [m for m in mem.get("measured", []) if m.get("pp") == pred["pp_rank"]]
        for k in KINDS:
            if ranks and k in ranks[0]:
                out.append((f"pp{pred['pp_rank']} {k}", pred[k], max(m[k] or 0 for m in ranks)))
    return out


def processes(name: str) -> int:
    """How many processes layout ``name`` runs (the product of its --tp, --pp and --dp)."""
    args = LAYOUTS[name]
    return math.prod(int(args[args.index(flag) + 1]) if flag in args else 1 for flag in ("--tp", "--pp", "--dp"))


def by_processes(rows: list[dict]) -> dict[int, dict]:
    """The geometric mean of the ratios of the layouts of each process count, and how many there are. Each
    count is predicted from its own section of the calibration (its processes' own kernel figures), so a
    count whose mean sits apart from the others points at that section rather than at a layout."""
    out = {}
    for p in sorted({processes(r["layout"]) for r in rows}):
        ratios = [r["ratio"] for r in rows if processes(r["layout"]) == p]
        out[p] = {"layouts": len(ratios), "geomean_ratio": math.exp(statistics.fmean(map(math.log, ratios)))}
    return out


def summarise(name: str, rounds: list[list[dict]], speeds: list[float], predicted: float | None,
              by_round: list[float] | None = None) -> dict:
    """One layout's row: the median steady step of every round against ``predicted`` (None: the first
    calibration's prediction, which the runs' metrics carry) and the median host speed before its runs;
    ``by_round``: each round's own prediction (from the calibrations either side of it), if made."""
    steady = [r for rows in rounds for r in rows if r["step"] > 2]
    measured = statistics.median(r["step_time_s"] for r in steady)
    per_round = [statistics.median(r["step_time_s"] for r in rows if r["step"] > 2) for rows in rounds]
    first = steady[0]["predicted_step_time_s"]  # the first round ran on the first calibration alone
    predicted = first if predicted is None else predicted
    bubbles = [r["measured_bubble"] for r in steady if r.get("measured_bubble") is not None]
    mem = memory_errors(rounds[-1])
    speed = statistics.median(speeds)
    return {"layout": name, "measured_s": measured, "measured_rounds_s": per_round,
            "rounds_apart": max(per_round) / min(per_round) - 1, "predicted_rounds_s": by_round or [],
            "round_ratios": [m / p for m, p in zip(per_round, by_round, strict=True)] if by_round else [],
            "predicted_s": predicted,
            "ratio": measured / predicted,
            "first_predicted_s": first, "first_ratio": measured / first,
            "host_speed": speed, "ratio_at_speed": measured / predicted * speed,
            "measured_bubble": statistics.median(bubbles) if bubbles else None,
            "predicted_bubble": steady[0].get("predicted_bubble"),
            "memory": [{"what": w, "predicted": p, "measured": m} for w, p, m in mem],
            "phases": phases(steady)}


def phases(steady: list[dict]) -> dict[str, dict[str, float]]:
    """Per phase of the step (``plait.plan.estimate.PHASES``): rank 0's median seconds over the steady steps
    and the first calibration's prediction (what the runs' metrics carry)."""
    pred = steady[0].get("predicted_phase_s") or {}
    measured = median_phases([r["phase_s"] for r in steady if r.get("phase_s")])
    return {k: {"measured": v, "predicted": pred.get(k)} for k, v in measured.items()}


def print_phases(rows: list[dict]) -> None:
    """Where each layout's step goes, measured beside predicted (the first calibration's), ms per phase."""
    print(f"by phase, rank 0's median ms measured / predicted (ratio): {', '.join(PHASES)}")
    for r in rows:
        cells = []
        for k in PHASES:
            x = r["phases"].get(k)
            if x is None or x["predicted"] is None:
                cells.append(f"{'-':>22}")
                continue
            ratio = f"({x['measured'] / x['predicted']:.2f})" if x["predicted"] > 0 else "(-)"
            cells.append(f"{x['measured'] * 1e3:>6.0f} / {x['predicted'] * 1e3:<6.0f} {ratio:>7}")
        print(f"{r['layout']:26} " + "  ".join(cells))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few layouts, one round (a smoke run)")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps of plait train per layout and round")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds over the layouts (default 2)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="calibration to use: read if the file exists, else made there and kept "
                             "(default: a fresh one, discarded)")
    parser.add_argument("--layouts", default=None, help="comma-separated layout names (default: all)")
    parser.add_argument("--interleave", action="store_true",
                        help="calibrate again between the rounds and after the last, and predict with the mean "
                             "of the calibrations (the first one's prediction is shown beside it)")
    args = parser.parse_args()
    args.names = list(QUICK if args.quick else LAYOUTS) if args.layouts is None else args.layouts.split(",")
    unknown = [n for n in args.names if n not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {unknown}; choose from {list(LAYOUTS)}")
    return args


def main() -> None:
    from plait.plan.host.profile import HostProfile

    args = parse_args()
    quick, steps, names = args.quick, args.steps, args.names
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as tmp:
        work = Path(tmp)
        env_load = [load()]
        profile = (args.profile or work / "host.toml").resolve()
        kept = profile.parent if args.profile else work  # each calibration on its own: STEM.N.toml
        cals: list[Path] = []  # in the order taken; ``profile`` is always their mean

        def calibrate_again() -> float:
            path = kept / f"{profile.stem}.{len(cals) + 1}.toml"
            seconds = calibrate(path)
            cals.append(path)
            HostProfile.average([HostProfile.load(c) for c in cals]).save(profile)
            return seconds

        if profile.is_file():
            cal_s = [0.0]
            if args.interleave:  # the profile becomes the mean: its first calibration kept as it was
                cals.append(kept / f"{profile.stem}.1.toml")
                HostProfile.load(profile).save(cals[0])
        else:
            cal_s = [calibrate_again()]
        rounds: dict[str, list[list[dict]]] = {n: [] for n in names}
        probes: dict[str, list[float]] = {n: [] for n in names}
        for i in range(args.rounds if args.rounds is not None else (1 if quick else 2)):
            if i and args.interleave:
                cal_s.append(calibrate_again())
            for n in names if i % 2 == 0 else names[::-1]:  # a drift over the run touches every layout alike
                probes[n].append(probe())
                rounds[n].append(run(n, profile, work, steps))
                env_load.append(load())
        if args.interleave:
            cal_s.append(calibrate_again())
        final = HostProfile.load(profile)
        predicted = {n: predict(n, profile, work) if args.interleave else None for n in names}
        by_round: dict[str, list[float]] = {n: [] for n in names}  # each round from the calibrations either side
        if args.interleave:
            for i in range(len(cals) - 1):
                bracket = work / f"bracket{i}.toml"
                HostProfile.average([HostProfile.load(c) for c in cals[i:i + 2]]).save(bracket)
                for n in names:
                    by_round[n].append(predict(n, bracket, work))
    mean_speed = float(final.host.get("speed_flops") or "nan")
    speeds = {n: [x / mean_speed for x in probes[n]] for n in names}
    rows = [summarise(n, rounds[n], speeds[n], predicted[n], by_round[n]) for n in names]
    report(rows, speeds, final, cal_s, env_load, profile, args.interleave)


def report(rows: list[dict], speeds: dict[str, list[float]], final, cal_s: list[float], env_load: list[str],
           profile: Path, interleave: bool) -> None:
    """The table, the diagnostics, the goals and the JSON of a finished run (``final``: its HostProfile)."""
    moved = final.host.get("speed_moved")
    print(f"calibration {' + '.join(f'{c:.0f}' for c in cal_s)} s ({profile}: the mean of {final.calibrations}; "
          f"the host's speed moved {'?' if moved is None else f'{float(moved):.0%}'} over them); load average "
          f"during the runs: {', '.join(env_load)} ({os.cpu_count()} cores)")
    print(f"{'layout':26} {'measured ms':>11} {'apart':>6} {'predicted':>9} {'ratio':>6} {'1st cal':>7} "
          f"{'host speed':>10} {'at speed':>8} {'bubble meas':>11} {'pred':>6}  memory (worst |error|)")
    for r in rows:
        worst = max(r["memory"], key=lambda x: abs(x["measured"] / x["predicted"] - 1) if x["predicted"] else 0,
                    default=None)
        mem = (f"{worst['what']}: {worst['measured'] / worst['predicted'] - 1:+.1%}" if worst and worst["predicted"]
               else "not measured")
        mb = f"{r['measured_bubble']:.1%}" if r["measured_bubble"] is not None else "-"
        pb = f"{r['predicted_bubble']:.1%}" if r["predicted_bubble"] is not None else "-"
        print(f"{r['layout']:26} {r['measured_s'] * 1e3:>11.0f} {r['rounds_apart']:>6.0%} "
              f"{r['predicted_s'] * 1e3:>9.0f} {r['ratio']:>6.2f} {r['first_ratio']:>7.2f} {r['host_speed']:>10.2f} "
              f"{r['ratio_at_speed']:>8.2f} {mb:>11} {pb:>6}  {mem}")
    print_phases(rows)
    counts = by_processes(rows)
    print("by process count (geometric mean of the ratios): " + "; ".join(
        f"{p}: {c['geomean_ratio']:.2f} ({c['layouts']} layout{'s' if c['layouts'] > 1 else ''})"
        for p, c in counts.items()))
    time_ok = all(abs(r["ratio"] - 1) <= GOAL_TIME for r in rows)
    mems = [x for r in rows for x in r["memory"] if x["predicted"]]
    mem_ok = bool(mems) and all(abs(x["measured"] / x["predicted"] - 1) <= GOAL_MEMORY for x in mems)
    drift = [x for v in speeds.values() for x in v if x == x]  # not nan
    if drift:
        print(f"the probe before the runs read {statistics.median(drift):.2f}x the calibration's mean speed (median; "
              f"{min(drift):.2f}-{max(drift):.2f}x; one reading moves 12-17% on its own: docs/planner-log.md, entry 4)")
    if any(len(r["measured_rounds_s"]) > 1 for r in rows):
        apart = sorted(r["rounds_apart"] for r in rows)
        print(f"the runs themselves: a layout's rounds (each the median of its steady steps) were "
              f"{statistics.median(apart):.0%} apart (median over the layouts; {apart[0]:.0%}-{apart[-1]:.0%}); "
              f"{sum(a > GOAL_TIME for a in apart)} of {len(rows)} more than {GOAL_TIME:.0%} apart")
    if any(r["round_ratios"] for r in rows):
        each = [x for r in rows for x in r["round_ratios"]]
        print(f"each round against the mean of the two calibrations either side of it (a diagnostic, not the goal): "
              f"{sum(abs(x - 1) <= GOAL_TIME for x in each)}/{len(each)} within {GOAL_TIME:.0%}; by layout, "
              + "; ".join(f"{r['layout']} " + " ".join(f"{x:.2f}" for x in r["round_ratios"]) for r in rows))
    at_speed = sum(abs(r["ratio_at_speed"] - 1) <= GOAL_TIME for r in rows)
    print(f"at the host's speed during each run (ratio x host speed, the prediction the calibration would have "
          f"made at that speed): {at_speed}/{len(rows)} within {GOAL_TIME:.0%} (a diagnostic, not the goal)")
    first_ok = all(abs(r["first_ratio"] - 1) <= GOAL_TIME for r in rows)
    if interleave:
        within = sum(abs(r["first_ratio"] - 1) <= GOAL_TIME for r in rows)
        print(f"the first calibration alone, made before any run: {within}/{len(rows)} within {GOAL_TIME:.0%} "
              f"({'PASS' if first_ok else 'FAIL'}); the goal below is judged on the mean of the "
              f"{final.calibrations} calibrations")
    print(f"goal: step time within {GOAL_TIME:.0%}: {'PASS' if time_ok else 'FAIL'}; memory within "
          f"{GOAL_MEMORY:.0%}: {'PASS' if mem_ok else ('FAIL' if mems else 'not measured')}")
    print(json.dumps({"load": env_load, "calibration_s": cal_s, "calibrations": final.calibrations,
                      "calibration_speed_moved": moved, "layouts": rows, "by_processes": counts,
                      "time_goal_met": time_ok,
                      "first_calibration_time_goal_met": first_ok,
                      "memory_goal_met": mem_ok, "cores": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
