"""Benchmark: schedule generation + validation + simulation time versus the number of actions.

Prints a table and JSON. Targets (issue 3): interleaved-1f1b P=32, M=256, V=2 under 1 s and
P=64, M=1024, V=4 under 10 s, generation included. Timings never go into tests.
"""

from __future__ import annotations

import json
import time

from plait.schedules import build_schedule
from plait.sim import Costs, simulate

CASES = [
    ("interleaved-1f1b", 8, 64, 2),
    ("interleaved-1f1b", 32, 256, 2),
    ("interleaved-1f1b", 64, 1024, 4),
    ("1f1b", 64, 1024, None),
    ("zb-h1", 64, 1024, None),
    ("zbv", 64, 1024, None),
    ("dualpipev", 64, 1024, None),
]


def run_case(name: str, p: int, m: int, v: int | None) -> dict:
    t0 = time.perf_counter()
    sched = build_schedule(name, stages=p, microbatches=m, virtual=v)
    t1 = time.perf_counter()
    sched.validate()
    t2 = time.perf_counter()
    result = simulate(sched, Costs(1.0, 2.0))
    t3 = time.perf_counter()
    n = sched.num_actions
    return {
        "schedule": name, "P": p, "M": m, "V": sched.virtual, "actions": n,
        "generate_s": t1 - t0, "validate_s": t2 - t1, "simulate_s": t3 - t2,
        "generate_plus_simulate_s": (t1 - t0) + (t3 - t2), "us_per_action": 1e6 * (t3 - t0) / n,
        "bubble": result.bubble_fraction,
    }


def main() -> None:
    rows = [run_case(*case) for case in CASES]
    head = f"{'schedule':<17}{'P':>4}{'M':>6}{'V':>3}{'actions':>10}{'gen s':>8}{'valid s':>9}" \
           f"{'sim s':>8}{'gen+sim s':>10}{'us/act':>8}{'bubble':>8}"
    print(head)
    for r in rows:
        print(f"{r['schedule']:<17}{r['P']:>4}{r['M']:>6}{r['V']:>3}{r['actions']:>10}{r['generate_s']:>8.3f}"
              f"{r['validate_s']:>9.3f}{r['simulate_s']:>8.3f}{r['generate_plus_simulate_s']:>10.3f}"
              f"{r['us_per_action']:>8.2f}{r['bubble']:>8.2%}")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
