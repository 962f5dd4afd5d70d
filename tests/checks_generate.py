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


class CharTokenizer:
    """Token id i is the one character chr(BASE + i): a stop string of a continuation's text is a run of its
    tokens, so where it ends decoding is known from the ids alone."""

    BASE = 0x4E00

    def encode(self, text: str) -> list[int]:
        return [ord(c) - self.BASE for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(self.BASE + int(i)) for i in ids)


def stop_texts_of(full: list[list[int]]) -> list[str]:
    """Stop strings that end each row of ``full`` (one device's continuations of PROMPTS) well before NEW tokens:
    the text of two consecutive tokens of each row (so a string completed by the second of them, where it ends)."""
    return [CharTokenizer().decode(full[i][k: k + 2]) for i, k in enumerate((4, 3, 1, 8))]


def cut_after_stop_text(full: list[list[int]], stops: list[str]) -> list[list[int]]:
    """Each row of ``full`` up to the token whose text completes the first of ``stops`` it holds."""
    tok, rows = CharTokenizer(), []
    for row in full:
        text = tok.decode(row)
        found = [text.find(s) + len(s) for s in stops if s in text]
        rows.append(row[: min(found)] if found else row)
    return rows


def trackers(stops: list[str]) -> list:
    """One TextTracker per prompt of PROMPTS with the stop strings ``stops``."""
    from plait.generation.text import TextTracker

    return [TextTracker(CharTokenizer(), stops, prompt=p) for p in PROMPTS]


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
    return {"full": full, "stops": {case: sorted(stops_of(rows)) for case, rows in full.items()},
            "stop_texts": {case: stop_texts_of(rows) for case, rows in full.items()}}


def decode(model_dir: Path, fields: dict, stops: dict, stop_texts: dict) -> dict:
    """Per case, under the layout ``fields``: this rank's tokens with the stop ids ``stops[case]``, the
    (chunk, group, position) items it ran, its chunks and the pipeline size; and its tokens and items with the stop
    strings ``stop_texts[case]`` instead."""
    from plait.generation.decode import Sampling, generate_ids
    from plait.generation.job import load_model

    out = {}
    with plait.init(config=ParallelConfig(**fields)) as ctx:
        ctx.set_timeout(WAIT_S)
        model = load_model(str(model_dir), ctx=ctx)[0]  # the `plait generate` loading path
        for case, args in CASES.items():
            trace: list = []
            ids = generate_ids(model, PROMPTS, Sampling(NEW, *args), trace=trace, stop_ids=stops[case])
            text_trace: list = []
            text_ids = generate_ids(model, PROMPTS, Sampling(NEW, *args), trace=text_trace,
                                    texts=trackers(stop_texts[case]))
            out[case] = {"ids": ids, "items": [(c, g, p) for c, g, p, _t0, _t1 in trace],
                         "chunks": sorted(model.chunks), "pp": ctx.pp_size, "text_ids": text_ids,
                         "text_items": [(c, g, p) for c, g, p, _t0, _t1 in text_trace]}
    return out


def rank_main(root: str) -> dict:
    from serve_util import tiny_model

    model_dir = tiny_model(Path(root) / f"tiny-{os.environ['RANK']}")  # each rank its copy (the same weights)
    ref: dict = {}  # the reference check's result, read by the layouts' checks
    return run_checks([("generate/reference", lambda: ref.setdefault("ref", reference(model_dir)))] + [
        (f"generate/{name}", lambda f=fields: decode(model_dir, f, ref["ref"]["stops"], ref["ref"]["stop_texts"]))
        for name, fields in LAYOUTS.items()])
