"""A whole Llama under TP x DP (sequence parallelism on/off, tied, GQA) equals one device; bad inputs fail."""

import pytest

from harness import result

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # parallel equals single device within float32 rounding


# world4: tests/conftest.py (one launch of 4 ranks shared with the other world-4 modules runs checks_llama)


LLAMA_CASES = [f"{tag}/sp{sp}/tied{tied}" for tag in ("tp4dp1", "tp2dp2") for sp in (0, 1) for tied in (0, 1)]
LLAMA_CASES += [f"{tag}/{case}" for tag in ("tp4dp1", "tp2dp2") for case in ("mha", "kv1", "microbatches2")]


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_llama_equals_single_device(world4, case):
    for rank, r in enumerate(result(world4, case)):
        assert r["n_grads"] > 10
        assert r["loss_rel"] <= LOSS_TOL, f"rank {rank} {case}: loss rel err {r['loss_rel']:.2e}"
        assert r["grad_rel_max"] <= GRAD_TOL, (
            f"rank {rank} {case}: grad rel err {r['grad_rel_max']:.2e} on {r['worst_grad']}")
        assert r["keys_equal"], "full_state_dict keys differ from the plain model's"
        assert r["params_exact"] == 0.0, "sharding is not TP-invariant: gathered weights differ"


@pytest.mark.parametrize("tag", ["tp4dp1", "tp2dp2"])
def test_state_dict_roundtrip_and_eval(world4, tag):
    for r in result(world4, f"{tag}/roundtrip"):
        assert r["max_err"] == 0.0
    for r in result(world4, f"{tag}/eval"):
        assert r["logits_rel"] <= 1e-5


@pytest.mark.parametrize("case,needle", [
    ("bad/tp_not_dividing_world", "tp"),
    ("bad/product_mismatch", "tp*pp*dp"),
    ("bad/heads", "n_heads"),
    ("bad/kv_heads", "n_kv_heads"),
    ("bad/ffn", "ffn_dim"),
    ("bad/tokens", "vocabulary"),
    ("bad/state_dict_shape", "layers.1.self_attn.q_proj.weight: (32, 1), expected (32, 32)"),
    ("bad/state_dict_key", "adds 1 keys, e.g. ['layers.2.mlp.up_proj.weight']"),
])
def test_bad_input_is_config_error_on_every_rank(world4, case, needle):
    for rank, r in enumerate(result(world4, case)):
        assert r["raised"] == "ConfigError", f"rank {rank}: {r}"
        assert needle in r["message"], f"rank {rank}: message does not name {needle!r}: {r['message']}"
