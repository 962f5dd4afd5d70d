"""Which layouts the prediction leans on, over several runs of ``bench/planner/plan_vs_run.py``.

One run of ``plan_vs_run.py`` cannot tell the model's error from the host's: this VM's speed moves by a
seventh to a third over a benchmark, and that moves every layout of a run together. Over several runs, a
layout's ratio (measured step over predicted) divided by its run's geometric mean takes the common part
out; a layout that sits on the same side of 1 in every run is the model's lean, not the host's.

Reads the saved output of ``plan_vs_run.py`` (its stdout, whose last part is its JSON, or the JSON alone),
one file per run, and prints per run the geometric mean of the ratios, their scatter (the standard
deviation of the log ratios about their mean) and how many were within the goal; then per layout its
ratio over its run's mean in each run, their range and geometric mean, most over-predicted first.
If the ratios of a run scatter log-normally by σ about 1, all n of them land within the goal with
probability (Φ(ln(1 + goal)/σ) - Φ(ln(1 - goal)/σ))^n; the last column of the first table is that for the
run's own σ.

Last, the noise floor: what the goal would give a model that is exact, under the noise the runs themselves
show. Runs that kept each layout's rounds (``measured_rounds_s``) give a round's scatter: pooled over the
layouts, σ_round² = mean((ln r1 - ln r2)²) / 2 for two rounds (the sample variance of the logs, in
general); a layout's figure, over R rounds, scatters by about σ_round/√R (σ_m). The runs' geometric means
scatter by σ_L (a whole run moves with the host's speed while it was calibrated and while it ran). If
every log ratio is L + e, L ~ N(0, σ_L) shared by a run and e ~ N(0, σ_m) per layout, then with
p(L) = Φ((ln(1 + goal) - L)/σ_m) - Φ((ln(1 - goal) - L)/σ_m), n layouts give n·E[p(L)] within the goal
on average and all n with probability E[p(L)^n]. Set beside the runs' own counts, that says how much of the
misses noise alone explains.

    python bench/planner/plan_vs_run.py --interleave --profile /tmp/ak.toml > ak.txt     # one run, ~15 min here
    python bench/planner/plan_leans.py ak.txt al.txt am.txt                               # the leans over them
    python bench/planner/plan_leans.py --json ak.txt al.txt                               # the same as JSON
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

GOAL = 0.15


def read_json(path: Path) -> dict:
    """The JSON of one saved ``plan_vs_run.py`` output (its whole stdout, or the JSON alone)."""
    text = path.read_text()
    start = 0 if text.lstrip().startswith("{") else text.find("\n{")
    if start < 0:
        raise SystemExit(f"{path}: no JSON of bench/planner/plan_vs_run.py in it (save its whole stdout)")
    try:
        data = json.loads(text[start:])
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{path}: its JSON does not parse ({exc}); save the whole stdout of one run") from None
    rows = data.get("layouts") if isinstance(data, dict) else None
    if not rows:
        raise SystemExit(f"{path}: its JSON has no 'layouts' (is it bench/planner/plan_vs_run.py's?)")
    return data


def ratios(data: dict) -> dict[str, float]:
    """Layout -> measured/predicted ratio of one run."""
    return {str(r["layout"]): float(r["ratio"]) for r in data["layouts"]}


def rounds(data: dict) -> dict[str, list[float]]:
    """Layout -> its rounds' step times (each the median of a round's steady steps), where the run kept them."""
    return {str(r["layout"]): [float(x) for x in r["measured_rounds_s"]] for r in data["layouts"]
            if len(r.get("measured_rounds_s") or ()) > 1}


def within(level: float, sigma: float, goal: float = GOAL) -> float:
    """Probability that a log ratio ~ N(level, sigma) lands within ``goal`` of 1."""
    lo, hi = math.log(1 - goal), math.log(1 + goal)
    if sigma <= 0:
        return float(lo <= level <= hi)
    phi = statistics.NormalDist()
    return phi.cdf((hi - level) / sigma) - phi.cdf((lo - level) / sigma)


def noise_floor(runs: dict[str, dict], goal: float = GOAL, points: int = 401) -> dict | None:
    """What an exact model would score under the runs' own noise (see the module's docstring), or None
    when no run kept its rounds. The expectation over the level is a sum over ``points`` values of L
    within ±6σ_L, weighted by the normal density."""
    pairs = [(math.log(x) for x in rs) for data in runs.values() for rs in rounds(data).values()]
    squares, dof, counts = 0.0, 0, []
    for logs in pairs:
        xs = list(logs)
        mean = statistics.fmean(xs)
        squares += sum((x - mean) ** 2 for x in xs)
        dof += len(xs) - 1
        counts.append(len(xs))
    if dof == 0:
        return None
    sigma_round = math.sqrt(squares / dof)
    sigma_m = sigma_round / math.sqrt(statistics.fmean(counts))
    levels = [statistics.fmean(math.log(x) for x in ratios(data).values()) for data in runs.values()]
    sigma_level = statistics.stdev(levels) if len(levels) > 1 else 0.0
    n = round(statistics.fmean(len(data["layouts"]) for data in runs.values()))
    if sigma_level > 0:
        grid = [sigma_level * (-6 + 12 * i / (points - 1)) for i in range(points)]
        weights = [math.exp(-0.5 * (x / sigma_level) ** 2) for x in grid]
    else:
        grid, weights = [0.0], [1.0]
    total = sum(weights)
    p = [within(x, sigma_m, goal) for x in grid]
    expected = n * sum(w * q for w, q in zip(weights, p, strict=True)) / total
    all_within = sum(w * q ** n for w, q in zip(weights, p, strict=True)) / total
    observed = [sum(abs(x - 1) <= goal for x in ratios(data).values()) for data in runs.values()]
    return {"sigma_round": sigma_round, "rounds_per_layout": statistics.fmean(counts), "pairs": len(counts),
            "sigma_measured": sigma_m, "sigma_level": sigma_level, "layouts": n, "expected_within": expected,
            "p_all_within": all_within, "observed_within": observed,
            "observed_all_within": sum(c == n for c in observed)}


def p_all_within(sigma: float, n: int, goal: float = GOAL) -> float:
    """Probability that n log-normal ratios of scatter ``sigma`` about 1 all fall within ``goal``."""
    if sigma <= 0:
        return 1.0
    phi = statistics.NormalDist()
    one = phi.cdf(math.log(1 + goal) / sigma) - phi.cdf(math.log(1 - goal) / sigma)
    return one ** n


def leans(runs: dict[str, dict[str, float]]) -> dict:
    """Per run: geometric mean, scatter, count within the goal; per layout: its ratio over its run's mean."""
    per_run = {}
    rel: dict[str, dict[str, float]] = {}
    for name, ratios in runs.items():
        logs = [math.log(x) for x in ratios.values()]
        mean = statistics.fmean(logs)
        sigma = statistics.pstdev(logs, mean)
        per_run[name] = {"geomean": math.exp(mean), "sigma": sigma, "layouts": len(ratios),
                         "within": sum(abs(x - 1) <= GOAL for x in ratios.values()),
                         "p_all_within_at_sigma": p_all_within(sigma, len(ratios))}
        for layout, x in ratios.items():
            rel.setdefault(layout, {})[name] = x / math.exp(mean)
    per_layout = {layout: {"by_run": v, "min": min(v.values()), "max": max(v.values()),
                           "geomean": statistics.geometric_mean(v.values()),
                           "same_side": all(x > 1 for x in v.values()) or all(x < 1 for x in v.values())}
                  for layout, v in rel.items()}
    order = sorted(rel, key=lambda k: -statistics.geometric_mean(rel[k].values()))
    return {"runs": per_run, "layouts": {k: per_layout[k] for k in order}}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("outputs", nargs="+", type=Path, help="saved stdout (or JSON) of plan_vs_run.py runs")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the tables")
    args = parser.parse_args()
    if len(args.outputs) < 2:
        parser.error("give at least two runs: a lean is what stays the same from one run to the next")
    data = {p.stem: read_json(p) for p in args.outputs}
    out = leans({name: ratios(d) for name, d in data.items()})
    out["noise_floor"] = noise_floor(data)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{'run':12} {'geomean':>8} {'sigma':>6} {'within':>7} {'P(all within) at sigma':>22}")
    for name, r in out["runs"].items():
        print(f"{name:12} {r['geomean']:>8.3f} {r['sigma']:>6.1%} {r['within']:>3}/{r['layouts']:<3} "
              f"{r['p_all_within_at_sigma']:>22.2f}")
    names = list(out["runs"])
    print(f"\n{'layout':26} " + " ".join(f"{n[:6]:>6}" for n in names) + "    range       geomean  same side")
    for layout, v in out["layouts"].items():
        cells = " ".join(f"{v['by_run'][n]:>6.2f}" if n in v["by_run"] else f"{'-':>6}" for n in names)
        print(f"{layout:26} {cells}    {v['min']:.2f}-{v['max']:.2f}   {v['geomean']:>7.3f}  "
              f"{'yes' if v['same_side'] else 'no'}")
    print("\n(each ratio over its run's geometric mean: the host's speed, common to a run, is out of it)")
    floor = out["noise_floor"]
    if floor is None:
        print("\nno run kept its rounds (measured_rounds_s): no noise floor")
        return
    obs = floor["observed_within"]
    print(f"\nthe noise floor: a round scatters by {floor['sigma_round']:.1%} ({floor['pairs']} layouts' rounds), a "
          f"layout's figure over {floor['rounds_per_layout']:.0f} rounds by {floor['sigma_measured']:.1%}; the runs' "
          f"geometric means by {floor['sigma_level']:.1%}")
    print(f"an exact model under that noise: {floor['expected_within']:.1f} of {floor['layouts']} within "
          f"{GOAL:.0%} on average, all {floor['layouts']} in {floor['p_all_within']:.0%} of runs; these runs: "
          f"{statistics.fmean(obs):.1f} on average ({', '.join(map(str, obs))}), all in {floor['observed_all_within']} "
          f"of {len(obs)}")


if __name__ == "__main__":
    main()
