"""bench/optim.py: its helpers, without running a world."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def optim():
    spec = importlib.util.spec_from_file_location("bench_optim", BENCH / "optim.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_run_picks_the_rank_holding_most_with_none_entries_in_the_report(optim):
    ranks = [{"rank": r, "measured": {"params": 10, "grads": 5 * r, "optimizer": 8, "activations_peak": 100 - r,
                                      "params_gathered_peak": None}} for r in range(3)]
    assert optim._most_held(ranks)["rank"] == 2
