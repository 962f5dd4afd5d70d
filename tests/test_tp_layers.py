"""Tensor/sequence-parallel collectives and layers equal their single-device definitions (tp 1, 2, 4)."""

from types import SimpleNamespace

import pytest

from harness import result
from plait.errors import ConfigError
from plait.tensor_parallel import ColumnParallelLinear, RowParallelLinear

TOL = 1e-10  # float64 inside these checks: parallel and dense differ only by summation order

LAYER_CHECKS = ["collectives", "column", "column_gather", "column_sp", "row", "row_sp", "row_scatter",
                "embedding", "embedding_sp", "cross_entropy"]


# world4: tests/conftest.py (one launch of 4 ranks shared with the other world-4 modules runs checks_tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("check", LAYER_CHECKS)
def test_layer_matches_dense(world4, tp, check):
    for rank, errs in enumerate(result(world4, f"tp{tp}/{check}")):
        numeric = {k: v for k, v in errs.items() if k != "pad_rows"}
        assert numeric, "the check measured nothing"
        bad = {k: v for k, v in numeric.items() if not v <= TOL}
        assert not bad, f"rank {rank}, tp={tp}, {check}: errors above {TOL}: {bad}"


def test_vocab_padding_used_when_not_divisible(world4):
    # vocab 37: tp=2 pads 1 row, tp=4 pads 3 rows; tp=1 none
    assert [r["pad_rows"] for r in result(world4, "tp4/embedding")] == [3] * 4
    assert [r["pad_rows"] for r in result(world4, "tp2/embedding")] == [1] * 4
    assert [r["pad_rows"] for r in result(world4, "tp1/embedding")] == [0] * 4


def test_a_size_tp_does_not_divide_is_refused_with_the_tp_sizes_that_do():  # before any collective or shard
    ctx = SimpleNamespace(tp_size=3)
    with pytest.raises(ConfigError, match=r"tp=3 does not divide the output size out_features=100; "
                                          r"valid tp: \[1, 2, 4, 5, 10, 20, 25, 50\]$"):
        ColumnParallelLinear(8, 100, ctx=ctx)
    with pytest.raises(ConfigError, match=r"the input size in_features=8; valid tp: \[1, 2, 4, 8\]$"):
        RowParallelLinear(8, 6, ctx=ctx)
