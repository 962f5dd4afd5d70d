"""plait generate under pp 2 runs groups of prompts as a wavefront over the stages, with one device's tokens."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness import PRELOAD
from plait.distributed.launch import run_world
from serve_util import tiny_model

pytestmark = pytest.mark.timeout(240)
PROMPTS = [[100, 101, 102], [7, 8, 9, 10, 11, 12], [40, 41], [65, 66, 67, 68], [1, 2, 3, 4, 5]]
CASES = {"greedy": (0.0, 0, 0), "sampled": (0.9, 8, 5)}


def _decode(model, prompts, case: str, trace: list | None = None) -> list[list[int]]:
    from plait.generation.decode import Sampling, generate_ids

    temperature, top_k, seed = CASES[case]
    return generate_ids(model, prompts, Sampling(10, temperature, top_k, seed), trace=trace)


def _rank(model_dir: str) -> dict:
    import plait
    from plait.generation.job import load_model
    from plait.models.llama import DecoderLayer

    with plait.init(1, 2, 1) as ctx:
        model = load_model(model_dir, ctx=ctx)[0]
        for block in (b for chunk in model.chunks.values() for b in chunk.blocks):
            if isinstance(block, DecoderLayer):  # each work item takes >= 10 ms: scheduler noise cannot reorder
                block.register_forward_hook(lambda *_: time.sleep(0.005))
        out = {}
        for case in CASES:
            for n in (5, 4, 1):  # 2 groups (uneven, even) and a single group
                trace: list = []
                out[f"{case}/{n}"] = (_decode(model, PROMPTS[:n], case, trace), trace)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[list[dict], Path]:
    model_dir = tiny_model(tmp_path_factory.mktemp("pipelined") / "tiny")
    # forked from a server that imported torch once (harness.PRELOAD): the launch is not what is tested here
    return run_world(_rank, 2, str(model_dir), timeout_s=200, preload=PRELOAD), model_dir


@pytest.mark.parametrize("case", list(CASES))
def test_pp2_tokens_equal_one_device(world, case):
    from plait.generation.job import load_model

    ranks, model_dir = world
    ref = load_model(str(model_dir))[0]
    for n in (5, 4, 1):
        expected = _decode(ref, PROMPTS[:n], case)
        for rank, res in enumerate(ranks):
            assert res[f"{case}/{n}"][0] == expected, (rank, n)


@pytest.mark.parametrize("case", list(CASES))
def test_stage0_starts_group1_before_the_last_stage_finishes_group0(world, case):
    ranks, _ = world
    first, last = ({(c, g, p): (t0, t1) for c, g, p, t0, t1 in r[f"{case}/4"][1]} for r in ranks)
    assert {c for c, _g, _p in first} == {0} and {c for c, _g, _p in last} == {1}
    assert {g for _c, g, _p in first} == {0, 1}
    # group 1 (rows 2, 3: the shorter prompts) reaches the last column of its rows first; greedy, it stops there
    positions = 1 + max(p for _c, g, p in first if g == 1)
    assert positions == (12 if case == "greedy" else 14)
    # (start, end) of each item's computation: the old loop ran the whole batch on stage 0, then on stage 1,
    # so a stage-0 computation never began before a stage-1 one of the same position ended
    for p in range(positions):
        assert first[(0, 1, p)][0] < last[(1, 0, p)][1], p
    if case == "greedy":  # no wait for the whole position: group 0 goes on while stage 1 works on group 1
        for p in range(positions - 1):
            assert first[(0, 0, p + 1)][0] < last[(1, 1, p)][1], p
    assert [k for k in first if k[2] == 0] == [(0, 0, 0), (0, 1, 0)]
