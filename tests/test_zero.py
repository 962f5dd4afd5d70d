"""ZeRO-1 (sharded fp32 masters) and ZeRO-2 over dp2·tp2·pp2 and dp4·tp2 (world 8, one launch): 5 clipped
AdamW steps equal one device; measured bytes per rank equal the formula of docs/optim.md exactly; a
checkpoint moves between ZeRO layouts without losing a bit. (ZeRO-1 in fp32, at dp2: tests/test_optim.py.)

dp4·tp2·pp2 would be a world of 16 Gloo processes: too slow on this 2-core machine, so dp4 is covered
with pp1 and pp2 with dp2."""

import pytest

from harness import result
from test_optim import BF16_LOSS_TOL, BF16_NORM_TOL, BF16_PARAM_TOL, NORM_TOL, PARAM_TOL

FP32 = ["dp2tp2pp2/zero2/tied/sp", "dp4tp2/zero2/sp", "dp4tp2ep2/moe/zero2"]
BF16 = ["dp2tp2pp2/zero1/bf16/zbv", "dp4tp2/zero1/bf16"]


# world8: tests/conftest.py (the launch of 8 ranks shared with tests/test_pipeline.py runs checks_zero.checks)

@pytest.mark.parametrize("case", FP32)
def test_zero_equals_single_device(world8, case):
    for rank, r in enumerate(result(world8, case)):
        assert r["norm_rel_max"] <= NORM_TOL, f"rank {rank} {case}: norm rel err {r['norm_rel_max']:.2e}"
        assert r["param_rel_max"] <= PARAM_TOL, f"rank {rank} {case}: param rel err {r['param_rel_max']:.2e} " \
                                                f"at {r['worst']}"
        assert r["loss_rel_max"] <= 1e-5, f"rank {rank} {case}: loss rel err {r['loss_rel_max']:.2e}"
        assert r["pad_zero"] in (None, True), f"rank {rank} {case}: padded vocabulary rows moved"


@pytest.mark.parametrize("case", BF16)
def test_zero_bf16_tracks_fp32(world8, case):
    for rank, r in enumerate(result(world8, case)):
        assert 1e-5 < r["loss_rel_max"] <= BF16_LOSS_TOL, f"rank {rank} {case}: losses {r['losses']}"
        assert r["norm_rel_max"] <= BF16_NORM_TOL, f"rank {rank} {case}: norms {r['norm_rel_max']:.2e}"
        assert r["param_rel_max"] <= BF16_PARAM_TOL, f"rank {rank} {case}: params {r['param_rel_max']:.2e}"


@pytest.mark.parametrize("case", FP32 + BF16)
def test_measured_bytes_equal_the_formula(world8, case):
    for rank, r in enumerate(result(world8, case)):
        for key in ("params", "grads", "optimizer"):
            assert r["memory"][key] == r["formula"][key], f"rank {rank} {case} {key}: {r['memory']} vs {r['formula']}"
        assert r["memory"]["activations_peak"] > 0


@pytest.mark.parametrize("case,dp", [("dp4tp2/zero2/sp", 4), ("dp2tp2pp2/zero2/tied/sp", 2), ("dp4tp2/zero1/bf16", 4)])
def test_state_is_split_over_data_parallel_ranks(world8, case, dp):
    """The DP replicas own disjoint shards covering every local element once, each 1/d of them (up to the
    padding of each bucket to a multiple of d)."""
    rows = result(world8, case)
    for rank, r in enumerate(rows):
        replicas = [rows[q] for q in range(len(rows)) if q % 2 == rank % 2 and q // (2 * dp) == rank // (2 * dp)]
        assert sum(x["formula"]["owned"] for x in replicas) == r["local_params"], f"rank {rank}: shards do not cover"
        assert abs(r["formula"]["owned"] - r["local_params"] / dp) <= dp * r["n_buckets"], r["formula"]


def test_zero2_keeps_a_quarter_of_the_gradients(world8):
    """Gradients are float32 whatever the precision: ZeRO-2 holds 1/dp of ZeRO-1's full buffers."""
    z1, z2 = result(world8, "dp4tp2/zero1/bf16"), result(world8, "dp4tp2/zero2/sp")
    for a, b in zip(z1, z2, strict=True):
        assert b["memory"]["grads"] * 4 == a["memory"]["grads"]
        assert a["memory"]["grads"] >= 4 * a["local_params"]


def test_bf16_masters_leave_bf16_parameters(world8):
    for r in result(world8, "dp4tp2/zero1/bf16"):
        assert r["memory"]["params"] == 2 * r["local_params"]


def test_checkpoint_moves_between_zero_layouts_exactly(world8):
    for rank, r in enumerate(result(world8, "reshard/bf16")):
        assert r["identical"], f"rank {rank}: a checkpoint reloaded under another layout saved different tensors"
        assert r["dtypes"] == ["float32"] and r["n_optim"] > 0, r
        assert r["loss_rel_max"] <= BF16_LOSS_TOL and r["param_rel_max"] <= BF16_PARAM_TOL, r
