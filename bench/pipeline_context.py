"""Benchmark: a pipeline's actions against the same chunks run outside the pipeline, in the same processes.

A calibrated-host prediction times a pipeline action as the work of its chunk alone. This checks that
directly, free of the host's drift between launches: one world of ``small`` (``plait.train.loop.build``, as
``plait train`` makes it) alternates step by step (A B B A ...) between

* ``pipeline``: a traced training step (``ParallelModel.train_step(trace=True)``), every rank's forward
  and backward actions summed (I and W count as backward);
* ``alone``: every rank runs its own chunks outside the schedule, at the same moment, one micro-batch at a
  time: a chunk's forward on an input of the micro-batch's shape (the tokens for the first chunk, a random
  hidden state for the others), then its backward from a random gradient of its output (the last chunk's
  logits stand in for its loss: the cross-entropy of a micro-batch is well under a millisecond here).

Only worlds whose processes do not outnumber the cores: there every rank of ``alone`` has a core, as every
rank of the pipeline has. Where they outnumber them, ``alone`` runs every process at once while the
pipeline's bubbles leave cores free, and the two are not alike (``bench/pipeline_sharing.py`` measures that
case). Prints per rank and kind the median milliseconds a step of each mode, and the ratio pipeline over
alone of adjacent steps (their total work), median and quartiles; ``--json`` for JSON only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from pipeline_sharing import BATCH, MICROBATCHES, SEQ, WARMUP, parse, small_config


def _rank_main(steps: int, pp: int, schedule: str) -> list[tuple[bool, list[tuple[float, float]]]] | None:
    import torch
    import torch.distributed as dist

    import plait
    from plait.train.data import batch
    from plait.train.loop import build

    cfg = small_config(pp, 1, schedule, BATCH, steps + WARMUP)
    ctx = plait.init(config=cfg.parallel)
    run = build(cfg, ctx)
    chunks = run.pm.chunks  # chunk index -> this rank's module
    width = int(run.pm.model_config.dim)  # the hidden state's width
    out = []
    for s in range(steps + WARMUP):
        x, y = batch(run.corpus.train, s, BATCH, SEQ, run.cfg.seed, (0, 1))  # [BATCH, SEQ] tokens
        in_pipeline = s % 4 in (0, 3)
        dist.barrier()
        forward = backward = 0.0
        if in_pipeline:
            run.pm.train_step(x, y, trace=True)
            for a, t0, t1 in run.pm.last_stats.timeline:
                if a.kind == "F":
                    forward += t1 - t0
                else:
                    backward += t1 - t0
        else:
            for tokens in x.chunk(MICROBATCHES):  # [BATCH / M, SEQ]
                for c in sorted(chunks):
                    t0 = time.perf_counter()
                    inp = tokens if c == 0 else torch.randn(tokens.shape[0], SEQ, width,
                                                            requires_grad=True)  # [b, SEQ, h]
                    result = chunks[c](inp)
                    t1 = time.perf_counter()
                    result.backward(torch.randn_like(result))
                    forward += t1 - t0
                    backward += time.perf_counter() - t1
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (forward, backward))
        if s >= WARMUP:
            out.append((in_pipeline, every))
    return out if dist.get_rank() == 0 else None


def summarise(case: str, steps: list[tuple[bool, list[tuple[float, float]]]]) -> dict[str, Any]:
    """Per rank and kind the median ms a step of each mode; the pipeline-over-alone ratios of adjacent steps."""
    def median_ms(in_pipeline: bool, rank: int, kind: int) -> float:
        return statistics.median(e[rank][kind] for p, e in steps if p == in_pipeline) * 1e3

    ranks = len(steps[0][1])
    per_rank = [{f"{name}_{mode}_ms": median_ms(mode == "pipeline", r, k)
                 for k, name in enumerate(("forward", "backward")) for mode in ("pipeline", "alone")}
                for r in range(ranks)]
    total = [sum(f + b for f, b in e) for _, e in steps]
    ratios = [(total[i] / total[i + 1]) if steps[i][0] else (total[i + 1] / total[i])
              for i in range(len(steps) - 1) if steps[i][0] != steps[i + 1][0]]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"case": case, "steps": len(steps), "ranks": per_rank,
            "ratio": {"pairs": len(ratios), "median": statistics.median(ratios), "quartiles": [q[0], q[2]]}}


def main() -> None:
    from plait.distributed.launch import run_world

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="pp2 1f1b,pp2 zbv", help="comma-separated, e.g. 'pp2 1f1b,pp2 gpipe'")
    ap.add_argument("--steps", type=int, default=40, help="steps per launch, half of them in each mode")
    ap.add_argument("--json", action="store_true", help="JSON only")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    rows = []
    for case in (c.strip() for c in args.cases.split(",")):
        pp, dp, schedule = parse(case)
        if dp != 1 or pp > cores:
            raise SystemExit(f"case {case!r}: only one replica (dp1) of at most {cores} stages (this host's "
                             "cores); bench/pipeline_sharing.py measures worlds that outnumber the cores")
        steps = next(r for r in run_world(_rank_main, pp, args.steps, pp, schedule, timeout_s=1800)
                     if r is not None)
        row = summarise(case, steps)
        rows.append(row)
        if not args.json:
            ratio = row["ratio"]
            print(f"{case}: pipeline over alone, adjacent steps' work: median {ratio['median']:.3f} "
                  f"(quartiles {ratio['quartiles'][0]:.3f}-{ratio['quartiles'][1]:.3f}, {ratio['pairs']} pairs)")
            for r, figures in enumerate(row["ranks"]):
                print(f"  rank {r}: forward {figures['forward_pipeline_ms']:.0f} ms in the pipeline, "
                      f"{figures['forward_alone_ms']:.0f} alone; backward {figures['backward_pipeline_ms']:.0f}, "
                      f"{figures['backward_alone_ms']:.0f}")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
