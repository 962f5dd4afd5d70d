"""ParallelOptimizer over TP x PP x DP (world 4, one launch): 5 clipped AdamW steps equal one device."""

import pytest

import checks_optim
from harness import result

PARAM_TOL, NORM_TOL = 1e-4, 1e-5
# bf16 weights/activations over fp32 masters and grads vs the fp32 single device, 5 steps (measured on
# this CPU: losses 7.2e-5, norms 5.1e-3, params 4.4e-2 relative — Adam turns bf16 gradient rounding into
# full-size update differences). Tolerances: about 10x / 4x / 2x the measured values.
BF16_LOSS_TOL, BF16_NORM_TOL, BF16_PARAM_TOL = 1e-3, 2e-2, 0.1


# world4: tests/conftest.py (one launch of 4 ranks shared with the other world-4 modules runs checks_optim)


FP32_CASES = ["tp2pp2/sp", "tp2dp2/zero1", "tp2dp2/zero0", "tp2dp2/zero1/own-group", "pp2dp2/tied", "pp2dp2/tied/zero1",
              "pp2dp2/tied/zero1-allreduce", "tp4/kv-replicated", "tp4/kv-replicated/sp", "etp/tp2dp2ep2/zero1",
              "etp/tp2dp2ep2/zero2", "etp/tp2dp2ep2/zero3"]


@pytest.mark.parametrize("case", FP32_CASES)
def test_clipped_adamw_equals_single_device(world4, case):
    for rank, r in enumerate(result(world4, case)):
        assert min(r["ref_norms"]) > checks_optim.CLIP, f"clipping was not active: norms {r['ref_norms']}"
        assert r["norm_rel_max"] <= NORM_TOL, f"rank {rank} {case}: norm rel err {r['norm_rel_max']:.2e}"
        assert r["param_rel_max"] <= PARAM_TOL, (
            f"rank {rank} {case}: param rel err {r['param_rel_max']:.2e} at {r['worst']}")
        assert r["loss_rel_max"] <= 1e-5, f"rank {rank} {case}: loss rel err {r['loss_rel_max']:.2e}"
        assert r["pad_zero"] in (None, True), f"rank {rank} {case}: padded vocabulary rows moved"


@pytest.mark.parametrize("case", ["tp2pp2/sp", "tp2dp2/zero1", "pp2dp2/tied", "tp4/kv-replicated"])
def test_norm_check_catches_miscounting(world4, case):
    """Counting replicated params on every TP rank (or both tied copies) moves the norm past 10x NORM_TOL."""
    for rank, r in enumerate(result(world4, case)):
        assert r["miscount_rel"] > 10 * NORM_TOL, f"rank {rank} {case}: miscounted norm only {r['miscount_rel']:.1e}"


def test_own_group_parameters_took_their_path(world4):
    """Parameters reduced over their own group (as experts are) are counted whole, outside the ZeRO slices."""
    assert [r["n_own"] for r in result(world4, "tp2dp2/zero1/own-group")] == [2] * 4
    assert [r["n_own"] for r in result(world4, "tp2dp2/zero1")] == [0] * 4


def test_padding_rows_checked(world4):
    """tp=2 with vocab 61 pads one row: the last TP rank saw it and it stayed zero."""
    flags = [r["pad_zero"] for r in result(world4, "tp2dp2/zero1")]
    assert flags.count(True) == 2 and flags.count(None) == 2, flags


def test_zero1_shards_optimizer_state(world4):
    """Under ZeRO-1 each DP rank holds about half the Adam moments of the unsharded optimizer."""
    full = result(world4, "tp2dp2/zero0")
    sharded = result(world4, "tp2dp2/zero1")
    for rank, (f, s) in enumerate(zip(full, sharded, strict=True)):
        moments = 2 * 4 * f["local_params"]  # fp32 exp_avg + exp_avg_sq
        assert moments <= f["state_bytes"] <= moments + 1024, f"rank {rank}: {f['state_bytes']} bytes"
        assert abs(s["state_bytes"] - f["state_bytes"] / 2) <= 8 * 32 + 1024, (
            f"rank {rank}: ZeRO-1 holds {s['state_bytes']} bytes, unsharded {f['state_bytes']}")


@pytest.mark.parametrize("case", ["tp2pp2/bf16", "tp2dp2/bf16/zero1", "pp2dp2/tied/bf16"])
def test_bf16_tracks_fp32_losses(world4, case):
    for rank, r in enumerate(result(world4, case)):
        assert r["loss_rel_max"] <= BF16_LOSS_TOL, (
            f"rank {rank} {case}: bf16 losses {r['losses']} vs fp32 {r['ref_losses']}")
        assert r["loss_rel_max"] > 1e-5, f"rank {rank} {case}: bf16 run equals fp32: the cast did not happen"
        assert r["norm_rel_max"] <= BF16_NORM_TOL, f"rank {rank} {case}: norms {r['norm_rel_max']:.2e}"
        assert r["param_rel_max"] <= BF16_PARAM_TOL, f"rank {rank} {case}: params {r['param_rel_max']:.2e}"


def test_resume_from_per_rank_state(world4):
    for rank, r in enumerate(result(world4, "tp2dp2/zero1/resume")):
        assert r["steps"] == checks_optim.STEPS
        assert r["param_rel_max"] <= PARAM_TOL, f"rank {rank}: resumed run differs by {r['param_rel_max']:.2e}"


def test_zero1_gathered_state_equals_unsharded(world4):
    """The per-parameter view a checkpointer saves: ZeRO-1 slices gathered equal the unsharded moments."""
    for rank, r in enumerate(result(world4, "tp2dp2/zero1/gathered")):
        assert r["moments_rel"] <= 1e-5, f"rank {rank}: moments differ by {r['moments_rel']:.2e}"
        assert r["steps_equal"], f"rank {rank}: step counters not carried"
        assert r["param_rel_max"] <= PARAM_TOL, f"rank {rank}: resumed from gathered state: {r['param_rel_max']:.2e}"


@pytest.mark.parametrize("case", ["tp2dp2/zero0", "tp2dp2/zero1", "tp2dp2/bf16/zero1", "pp2dp2/tied/zero1",
                                  "pp2dp2/tied/zero1-allreduce", "tp2pp2/bf16", "pp2dp2/tied/bf16"])
def test_measured_bytes_equal_the_formula(world4, case):
    """memory_report's params, grads and optimizer bytes equal docs/optim.md's formula (tests/test_zero.py: ZeRO-2)."""
    for rank, r in enumerate(result(world4, case)):
        for key in ("params", "grads", "optimizer"):
            assert r["memory"][key] == r["formula"][key], f"rank {rank} {case} {key}: {r['memory']} vs {r['formula']}"


def test_activation_peak_counts_each_saved_storage_once(world4):
    for r in result(world4, "memory/activations"):
        assert r["keys"] == ["activations_peak", "grads", "optimizer", "params", "params_gathered_peak"]
        assert r["report"]["params_gathered_peak"] is None  # ZeRO-3 only
        assert r["report"]["activations_peak"] == r["expected"], r
        assert r["report"]["optimizer"] == 0 and r["report"]["params"] > 0 and r["report"]["grads"] > 0
        assert r["after_unmeasured"] == r["expected"]  # kept from the measured step
