"""Mixture-of-experts under EP x TP x PP x DP (world 4, one launch) equals the single-device MoE model."""

import pytest

from harness import result

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
CASES = [
    "dp4ep2/1f1b", "dp4ep4/1f1b", "dp4ep4/top1_all_to_one", "dp4ep4/empty_experts", "dp4ep4/capacity",
    "tp2dp2ep4/1f1b", "tp2dp2ep4/sp", "tp2dp2ep2/sp/moe_every2", "tp2dp2ep1/1f1b", "tp2pp2ep2/1f1b",
    "tp2pp2ep2/zbv/sp", "tp2pp2ep2/interleaved", "tp2pp2ep2/zbv/sp/selective", "tp2pp2ep2/zbv/sp/full",
    "pp2dp2ep2/zb-h1/selective", "pp2dp2ep2/gpipe", "pp2dp2ep2/zb-h1", "pp2dp2ep2/dualpipev",
    "pp2dp2ep2/looped-bfs", "pp2dp2ep2/all_to_one", "after_bad/still_works",
    "etp/tp2dp2ep2/1f1b", "etp/tp2dp2ep2/sp/top1", "etp/tp2dp2ep1/sp", "etp/tp2pp2/1f1b", "etp/tp2pp2/zbv/sp",
    "etp/tp2pp2/zb-h1/capacity",
]
EXTRAS = ["etp/tp2dp2ep2/1f1b", "etp/tp2dp2ep1/sp", "etp/tp2pp2/1f1b"]
# bf16 (weights, activations and their gradients) against one device's bf16, one step, routing that rounding
# cannot flip (checks_experts: every token to every expert): the tolerances of dense bf16 layouts
# (tests/test_context.py)
BF16_CASES = ["bf16/dp4ep2/every_expert", "bf16/tp2dp2ep2/sp/every_expert", "etp/bf16/tp2dp2ep2/every_expert"]
BF16_LOSS_TOL, BF16_GRAD_TOL = 1e-4, 5e-2


# world4: tests/conftest.py (one launch of 4 ranks shared with the other world-4 modules runs checks_experts)


@pytest.mark.parametrize("case", CASES)
def test_equals_single_device(world4, case):
    for rank, r in enumerate(result(world4, case)):
        assert r["keys_match"], f"rank {rank} {case}: full_state_dict keys differ from the plain model's"
        assert r["loss_rel"] <= LOSS_TOL, f"rank {rank} {case}: loss rel err {r['loss_rel']:.2e}"
        assert r["aux_rel"] <= LOSS_TOL, f"rank {rank} {case}: aux loss {r['aux']} rel err {r['aux_rel']:.2e}"
        assert r["grad_rel_max"] <= GRAD_TOL, f"rank {rank} {case}: grad err {r['grad_rel_max']:.2e} {r['worst']}"
        assert r["weights_rel"] == 0.0, f"rank {rank} {case}: gathered weights differ"
        assert r["expert_grad_norm"] > 0
        per = r["n_experts"] // r["ep"]
        assert len(r["local_experts"]) == per, f"rank {rank} {case}: holds experts {r['local_experts']}"
        assert r["local_experts"][0] == r["ep_rank"] * per
        assert r["load_counts"] == r["ref_counts"], f"rank {rank} {case}: assignments (per layer, dropped) differ"
        assert r["expert_rows"] == ({24} if case.startswith("etp/") else {48}), r["expert_rows"]  # ffn_dim/tp


@pytest.mark.parametrize("case", BF16_CASES)
def test_bf16_equals_single_device_bf16(world4, case):
    """Expert parallelism adds no error of its own to bf16: expert gradients reduced over their expert-data-
    parallel group, gates and dispatch as one device computes them in bf16. (With every expert chosen the
    auxiliary loss is constant, so its bf16 gradient is not exercised here.)"""
    for rank, r in enumerate(result(world4, case)):
        assert r["keys_match"] and r["weights_rel"] == 0.0, f"rank {rank} {case}"
        assert r["load_counts"] == r["ref_counts"], f"rank {rank} {case}: routing differs from one device's"
        assert r["loss_rel"] <= BF16_LOSS_TOL, f"rank {rank} {case}: loss rel err {r['loss_rel']:.2e}"
        assert r["aux_rel"] <= BF16_LOSS_TOL, f"rank {rank} {case}: aux loss rel err {r['aux_rel']:.2e}"
        assert r["grad_rel_max"] <= BF16_GRAD_TOL, f"rank {rank} {case}: grad err {r['grad_rel_max']:.2e} {r['worst']}"
        assert r["expert_grad_norm"] > 0


@pytest.mark.parametrize("case", EXTRAS)
def test_expert_tp_norm_and_checkpoint(world4, case):
    """Expert shards: the optimizer counts every element once; the checkpoint writes each region once."""
    for rank, r in enumerate(result(world4, case)):
        assert r["norm_rel"] <= GRAD_TOL, f"rank {rank} {case}: grad norm rel err {r['norm_rel']:.2e}"
        assert r["ckpt_rel"] == 0.0, f"rank {rank} {case}: checkpointed weights differ"
        assert r["reload_rel"] == 0.0, f"rank {rank} {case}: reloaded weights differ"


def test_routing_extremes_really_happen(world4):
    assignments = 8 * 8 * 4  # batch x sequence x MoE layers, per choice
    one = result(world4, "dp4ep4/top1_all_to_one")[0]["load"]
    assert sorted(one) == [0, 0, 0, assignments], one  # every token to one expert: three EP ranks idle
    empty = result(world4, "dp4ep4/empty_experts")[0]["load"]  # top-2 of 8: six experts get nothing
    assert sorted(empty) == [0] * 6 + [assignments] * 2, empty
    pp = result(world4, "pp2dp2ep2/all_to_one")[0]["load"]
    assert sorted(pp) == [0, 0, 0, assignments], pp


def test_capacity_really_drops(world4):
    dropless = sum(result(world4, "dp4ep4/1f1b")[0]["load"])
    capped = sum(result(world4, "dp4ep4/capacity")[0]["load"])
    assert capped < dropless, (capped, dropless)
    assert sum(result(world4, "dp4ep4/capacity")[0]["ref_counts"][1]) == dropless - capped


@pytest.mark.parametrize("case,needles", [
    ("bad/experts_not_divisible", ("n_experts=6", "ep=4")),
    ("bad/ep_dense_model", ("ep=2", "n_experts")),
    ("bad/ep_not_dividing_plane", ("ep=4",)),
    ("bad/top_k", ("top_k=5",)),
    ("bad/expert_tp_ep_not_dividing_dp", ("ep=4", "dp=2", "expert_tp")),
])
def test_bad_input_is_config_error_everywhere(world4, case, needles):
    for rank, r in enumerate(result(world4, case)):
        assert r["raised"] == "ConfigError", f"rank {rank}: {r}"
        for needle in needles:
            assert needle in r["message"], r["message"]
