"""Rank side of tests/test_generate_eos.py (4 ranks): the decode loop's stop under every layout generate runs on
(pipeline stages 2 and 4, interleaved and V-shaped chunk placements, tensor and data parallel replicas, ZeRO-3): each
rank's tokens and the work items it ran, against one device's tokens cut at the stop ids."""

from __future__ import annotations

import os
from pathlib import Path

import plait
from harness import run_checks
from plait.parallel_config import ParallelConfig

PROMPTS = [[100, 101, 102], [7, 8, 9, 10, 11, 12], [40, 41], [65, 66, 67, 68]]
NEW = 16
CASES = {"greedy": (0.0, 0, 0), "sampled": (0.9, 8, 5)}
#: layout name -> ParallelConfig fields; zbv places the last chunk on pipeline rank 0, beside the first; under
#: ZeRO-3 every block's forward gathers its parameters over dp, so the replicas must run the same items
LAYOUTS = {"tp2pp2": dict(tp=2, pp=2, dp=1), "pp4": dict(tp=1, pp=4, dp=1), "pp2dp2": dict(tp=1, pp=2, dp=2),
           "tp2dp2": dict(tp=2, pp=1, dp=2), "tp2dp2/zero3": dict(tp=2, pp=1, dp=2, zero=3),
           "pp2dp2/interleaved": dict(tp=1, pp=2, dp=2, schedule="interleaved-1f1b", virtual_stages=2),
           "pp2dp2/zbv": dict(tp=1, pp=2, dp=2, schedule="zbv")}
#: seconds a rank waits for a peer before its receive or collective fails, naming what it waited on (the
#: decoding itself takes well under a second): a rank that skipped an item another one waits for fails its
#: layout's check, saved before the group's bound (conftest.WORLD4_GROUPS) ends the launch
WAIT_S = 30.0


def stops_of(full: list[list[int]]) -> set[int]:
    """Stop ids that end each row of PROMPTS' continuations ``full`` well before NEW tokens (at the latest at the
    token picked from it; rows 0, 1 and 2, 3 stop at different positions)."""
    return {full[i][k] for i, k in enumerate((4, 3, 1, 8))}


def reference(model_dir: Path) -> dict:
    """One device's full continuations and the stop ids per case (every rank computes the same)."""
    from plait.generation.decode import Sampling, generate_ids
    from plait.generation.job import load_model

    ref = load_model(str(model_dir))[0]
    full = {case: generate_ids(ref, PROMPTS, Sampling(NEW, *args)) for case, args in CASES.items()}
    return {"full": full, "stops": {case: sorted(stops_of(rows)) for case, rows in full.items()}}


def decode(model_dir: Path, fields: dict, stops: dict) -> dict:
    """Per case, under the layout ``fields``: this rank's tokens with the stop ids ``stops[case]``, the
    (chunk, group, position) items it ran, its chunks and the pipeline size."""
    from plait.generation.decode import Sampling, generate_ids
    from plait.generation.job import load_model

    out = {}
    with plait.init(config=ParallelConfig(**fields)) as ctx:
        ctx.set_timeout(WAIT_S)
        model = load_model(str(model_dir), ctx=ctx)[0]  # the `plait generate` loading path
        for case, args in CASES.items():
            trace: list = []
            ids = generate_ids(model, PROMPTS, Sampling(NEW, *args), trace=trace, stop_ids=stops[case])
            out[case] = {"ids": ids, "items": [(c, g, p) for c, g, p, _t0, _t1 in trace],
                         "chunks": sorted(model.chunks), "pp": ctx.pp_size}
    return out


def rank_main(root: str) -> dict:
    from serve_util import tiny_model

    model_dir = tiny_model(Path(root) / f"tiny-{os.environ['RANK']}")  # each rank its copy (the same weights)
    ref: dict = {}  # the reference check's result, read by the layouts' checks
    return run_checks([("generate/reference", lambda: ref.setdefault("ref", reference(model_dir)))] + [
        (f"generate/{name}", lambda f=fields: decode(model_dir, f, ref["ref"]["stops"]))
        for name, fields in LAYOUTS.items()])
