"""Benchmark: the model's figure for each layout's work, against that work timed in rotation in one launch.

``bench/plan_vs_run.py`` compares whole runs made minutes apart, on a host whose speed moves 14-51% over
that time: a layout that came out high may have met a slow minute, or the model may lean on it. This
separates the two for the part of a step the model costs from kernel figures, the forward and backward
work of each rank's chunks. One world of as many processes as the largest mode uses (4 by default) rotates
step by step over the modes below (in order, then in reverse, and again: a drift within a rotation touches
every mode alike). In each mode the processes it uses run at once, each with the threads ``plait train``
gives a world of that size, and each does what it does in that layout's step: for each of the step's
micro-batches, its chunk's forward then its backward (from a random gradient of the output; the last
chunk's logits stand in for the loss, which is well under a millisecond here); the other processes wait.

* ``single``: one process, the whole model, micro-batches of ``BATCH / M`` sequences;
* ``dpN``: N processes, each the whole model on ``BATCH / (N·M)`` sequences a micro-batch;
* ``ppN``: N processes, each its pipeline rank's one chunk (the runtime's balanced cut, no virtual stages)
  on ``BATCH / M``;
* ``ppN dpK``: both.

Each mode is predicted as ``plait train --cluster FILE`` costs that layout's compute: the calibrated
profile's per-micro-batch forward and backward of every rank's chunks (``plan.timing.rank_costs``), at the
speeds one process gets with every process of its section computing (alone for one process), times the
micro-batches. Per rotation, each mode's measured over predicted is divided by the geometric mean of all
modes' in that rotation: that is the model's lean on the mode, free of the host's drift (a host running
uniformly slow moves every mode alike). Printed per mode: the median measured and predicted ms a step (the
mean over its processes), their ratio, and the lean with its quartiles over the rotations. The bubbles,
point-to-point hand-offs, collectives and the optimizer are not in it: where its leans are small and a
layout's in ``plan_vs_run`` are not, the cause is in those parts or in the host's drift. ``--profile`` may
be repeated: the same launch read under several calibrations shows how far a calibration alone moves the
leans. ``--json`` for JSON only.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline_sharing import BATCH, MICROBATCHES, SEQ, small_config
from plan_vs_run import calibrate

WARMUP_ROTATIONS = 1
DEFAULT_MODES = ("single", "dp2", "pp2", "dp4", "pp4", "pp2 dp2")


def parse_mode(mode: str) -> tuple[int, int]:
    """``pp2 dp2`` -> (pp 2, dp 2); ``single`` -> (1, 1)."""
    pp = dp = 1
    for word in mode.split():
        if word == "single":
            continue
        if word[:2] in ("pp", "dp") and word[2:].isdigit() and int(word[2:]) > 0:
            pp, dp = (int(word[2:]), dp) if word[:2] == "pp" else (pp, int(word[2:]))
        else:
            raise SystemExit(f"mode {mode!r}: {word!r} is not 'single', ppN or dpN")
    if BATCH % (dp * MICROBATCHES):
        raise SystemExit(f"mode {mode!r}: {BATCH} sequences do not split into dp {dp} x {MICROBATCHES} micro-batches")
    return pp, dp


def _rank_main(modes: list[str], rotations: int) -> list[tuple[str, list[float | None]]] | None:
    import torch
    import torch.distributed as dist

    from plait.distributed.launch import worker_threads
    from plait.models import Llama
    from plait.models.family import family_of
    from plait.pipeline.partition import build_chunks
    from plait.train.config import model_config

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Llama(model_config(small_config(1, 1)))
    family = family_of(model)
    vocab, width = model.config.vocab_size, model.config.dim
    work: dict[str, Any] = {}  # mode -> (threads, [(chunk index, module)], sequences a micro-batch), None: waits
    for mode in modes:
        pp, dp = parse_mode(mode)
        if rank >= pp * dp:
            work[mode] = None
            continue
        chunks = build_chunks(family.blocks(model), family.layer_costs(model), pp, "balanced") if pp > 1 else [model]
        work[mode] = (worker_threads(pp * dp), [(i, chunks[i]) for i in ([rank % pp] if pp > 1 else [0])],
                      BATCH // (dp * MICROBATCHES))
    order = list(modes) + list(modes)[::-1]
    out = []
    for step in range((rotations + WARMUP_ROTATIONS) * len(order)):
        mode = order[step % len(order)]
        dist.barrier()
        seconds = None
        if work[mode] is not None:
            threads, mine, mb = work[mode]
            torch.set_num_threads(threads)
            seconds = 0.0
            for _ in range(MICROBATCHES):
                for index, chunk in mine:
                    t0 = time.perf_counter()
                    x = torch.randint(vocab, (mb, SEQ)) if index == 0 else torch.randn(mb, SEQ, width,
                                                                                       requires_grad=True)
                    y = chunk(x)  # [mb, SEQ, width] or logits [mb, SEQ, vocab]
                    y.backward(torch.randn_like(y))
                    seconds += time.perf_counter() - t0
            torch.set_num_threads(1)
        every: list[Any] = [None] * world
        dist.all_gather_object(every, seconds)
        if step >= WARMUP_ROTATIONS * len(order):
            out.append((mode, every))
    return out if rank == 0 else None


def predicted(profile: Any, mode: str) -> float:
    """Seconds of a step's forward + backward compute of ``mode`` as the planner costs it, the mean over the
    pipeline ranks (every data-parallel replica does the same)."""
    from plait.plan.host.costs import HostCosts
    from plait.plan.timing import rank_costs
    from plait.train.predict import planner_inputs

    pp, dp = parse_mode(mode)
    world = pp * dp
    model, layout, training = planner_inputs(small_config(pp, dp), world)
    costs = HostCosts(profile, world, shared=world > 1)
    ranks = rank_costs(costs, model, layout, training.precision)
    return MICROBATCHES * statistics.fmean(c.f_compute + c.b_compute + c.recompute for c in ranks)


def summarise(steps: list[tuple[str, list[float | None]]], predictions: dict[str, float]) -> list[dict]:
    """Per mode: median measured and predicted seconds, and the lean (measured over predicted, over the
    rotation's geometric mean of that ratio) with its quartiles over the rotations."""
    modes = list(predictions)
    per = 2 * len(modes)
    measured = [(mode, statistics.fmean(s for s in every if s is not None)) for mode, every in steps]
    leans: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(len(measured) // per):
        rotation = measured[r * per:(r + 1) * per]
        ratio = {m: statistics.fmean(s for k, s in rotation if k == m) / predictions[m] for m in modes}
        mean = math.exp(statistics.fmean(math.log(v) for v in ratio.values()))
        for m in modes:
            leans[m].append(ratio[m] / mean)
    rows = []
    for m in modes:
        seconds = statistics.median(s for k, s in measured if k == m)
        q = statistics.quantiles(leans[m], n=4) if len(leans[m]) > 1 else [leans[m][0]] * 3
        rows.append({"mode": m, "measured_ms": seconds * 1e3, "predicted_ms": predictions[m] * 1e3,
                     "ratio": seconds / predictions[m], "lean": statistics.median(leans[m]),
                     "lean_quartiles": [q[0], q[2]], "rotations": len(leans[m])})
    return rows


def main() -> None:
    from plait.distributed.launch import run_world
    from plait.plan.host.profile import HostProfile

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated: single, ppN, dpN, 'ppN dpK'")
    ap.add_argument("--rotations", type=int, default=8, help="rotations over the modes (each: forward, then reverse)")
    ap.add_argument("--profile", type=Path, action="append", default=None,
                    help="calibrated profile to predict with; repeat it to read the same launch under several "
                         "(default: a fresh `plait calibrate`, discarded)")
    ap.add_argument("--json", action="store_true", help="JSON only")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",")]
    world = max(math.prod(parse_mode(m)) for m in modes)
    with tempfile.TemporaryDirectory(prefix="plait-bench-") as tmp:
        paths = args.profile
        if paths is None:
            paths = [Path(tmp) / "host.toml"]
            calibrate(paths[0])
        predictions = {str(p): {m: predicted(HostProfile.load(p), m) for m in modes} for p in paths}
    t0 = time.perf_counter()
    steps = next(r for r in run_world(_rank_main, world, modes, args.rotations, timeout_s=3600) if r is not None)
    elapsed = time.perf_counter() - t0
    results = [{"profile": p, "modes": summarise(steps, pred)} for p, pred in predictions.items()]
    if not args.json:
        print(f"{world} processes, {args.rotations} rotations in {elapsed:.0f} s")
        for result in results:
            print(f"predicted with {result['profile'] if args.profile else 'a fresh calibration'}:")
            print(f"  {'mode':10} {'measured ms':>11} {'predicted':>9} {'ratio':>6} {'lean':>6}  quartiles")
            for r in result["modes"]:
                q = r["lean_quartiles"]
                print(f"  {r['mode']:10} {r['measured_ms']:>11.0f} {r['predicted_ms']:>9.0f} {r['ratio']:>6.2f} "
                      f"{r['lean']:>6.3f}  {q[0]:.3f}-{q[1]:.3f}")
    print(json.dumps({"world": world, "rotations": args.rotations, "results": results}, indent=1))


if __name__ == "__main__":
    main()
