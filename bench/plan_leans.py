"""Which layouts the prediction leans on, over several runs of ``bench/plan_vs_run.py``.

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

    python bench/plan_vs_run.py --interleave --profile /tmp/ak.toml > ak.txt     # one run, ~15 min here
    python bench/plan_leans.py ak.txt al.txt am.txt                               # the leans over them
    python bench/plan_leans.py --json ak.txt al.txt                               # the same as JSON
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

GOAL = 0.15


def read_run(path: Path) -> dict[str, float]:
    """Layout -> measured/predicted ratio of one saved ``plan_vs_run.py`` output."""
    text = path.read_text()
    start = 0 if text.lstrip().startswith("{") else text.find("\n{")
    if start < 0:
        raise SystemExit(f"{path}: no JSON of bench/plan_vs_run.py in it (save its whole stdout)")
    try:
        data = json.loads(text[start:])
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{path}: its JSON does not parse ({exc}); save the whole stdout of one run") from None
    rows = data.get("layouts") if isinstance(data, dict) else None
    if not rows:
        raise SystemExit(f"{path}: its JSON has no 'layouts' (is it bench/plan_vs_run.py's?)")
    return {str(r["layout"]): float(r["ratio"]) for r in rows}


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
    parser.add_argument("outputs", nargs="+", type=Path, help="saved stdout (or JSON) of bench/plan_vs_run.py runs")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the tables")
    args = parser.parse_args()
    if len(args.outputs) < 2:
        parser.error("give at least two runs: a lean is what stays the same from one run to the next")
    runs = {p.stem: read_run(p) for p in args.outputs}
    out = leans(runs)
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


if __name__ == "__main__":
    main()
