"""bench/optim.py --zero3 reports as it goes: a line before each world and after it (a run is many minutes long
and printed nothing until its end), its --help says how long it takes, and the per-op memory sample is cheap."""

from __future__ import annotations

import re

import pytest

from file_module import load


@pytest.fixture(scope="module")
def optim():
    return load("bench/optim.py", "bench_optim")


def _result(dp: int, mb: int) -> dict:
    peers = ("plait zero1", "plait zero2", "plait zero3", "torch FSDP2")
    return {name: {"step_ms": 10.0 * (i + dp + mb), "held": 2**20, "peak": (i + 2) * 2**20, "peak_min": 2**20,
                   "norms": [1.0, 0.5, 0.25]} for i, name in enumerate(peers)}


def test_zero3_prints_a_line_before_each_world_runs_and_passes_the_step_counts(optim, capsys, monkeypatch):
    import plait.distributed.launch as launch

    seen = []

    def fake_run_world(fn, nprocs, dp, mb, steps, peak_steps, timeout_s):
        printed = capsys.readouterr().out  # what the user has seen when this world starts
        seen.append((printed, nprocs, dp, mb, steps, peak_steps))
        return [_result(dp, mb)] * nprocs

    monkeypatch.setattr(launch, "run_world", fake_run_world)
    optim.zero3_main(steps=3, peak_steps=1)
    assert [s[1:] for s in seen] == [(dp, dp, mb, 3, 1) for dp, mb in optim.ZERO3_WORLDS]
    for i, (printed, _, dp, mb, _, _) in enumerate(seen):
        assert f"world {i + 1}/{len(seen)}: dp{dp}, {mb} micro-batch" in printed, printed
        if i:
            assert f"world {i}/{len(seen)} done in" in printed, printed
    tail = capsys.readouterr().out
    assert f"world {len(seen)}/{len(seen)} done in" in tail
    assert tail.index("done in") < tail.index("vs FSDP2")  # progress first, then the table


def test_progress_lines_come_from_rank_zero_only(optim, capsys):
    optim._say(1, "from rank 1")
    optim._say(0, "from rank 0")
    out = capsys.readouterr().out
    assert "from rank 0" in out and "from rank 1" not in out


def test_help_says_how_long_it_takes_with_examples(optim):
    text = optim.parser().format_help()
    assert re.search(r"default run takes ~?\d+", text), text
    assert re.search(r"--zero3 .* takes ~?\d+", text.replace("\n", " ")), text
    assert "Examples:" in text and "--zero3 --steps" in text


def test_step_counts_below_one_are_refused(optim, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["optim.py", "--zero3", "--steps", "0"])
    with pytest.raises(SystemExit):
        optim.main()
    assert "--steps and --peak-steps must be at least 1" in capsys.readouterr().err


def test_memory_sample_looks_libc_up_once_and_sees_a_new_tensor(optim):
    import torch

    before = optim._in_use()
    t = torch.empty(4 * 2**20, dtype=torch.uint8)
    assert optim._in_use() - before >= t.numel()
    assert optim._mallinfo2.cache_info().misses == 1


def test_default_run_picks_the_rank_holding_most_with_none_entries_in_the_report(optim):
    ranks = [{"rank": r, "measured": {"params": 10, "grads": 5 * r, "optimizer": 8, "activations_peak": 100 - r,
                                      "params_gathered_peak": None}} for r in range(3)]
    assert optim._most_held(ranks)["rank"] == 2
