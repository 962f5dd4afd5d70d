"""Sequence parallelism keeps each region's sequence shard for the backward and all-gathers it again there
(plait.tensor_parallel.regather): fewer bytes saved, one more all-gather per region in the backward, and the
same loss and gradients as one device, with recomputation and with a zero-bubble schedule."""

import pytest

from harness import result

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4


# world4: tests/conftest.py (one launch of 4 ranks shared with the other world-4 modules runs checks_regather)


@pytest.mark.parametrize("kv", [2, 1])  # kv 1 < tp 2: K and V replicated (ReplicatedHeadsLinear)
@pytest.mark.parametrize("split", ["plain", "zb"])
def test_region_keeps_its_shard_and_gathers_once_in_backward(world4, kv, split):
    """tp2 with SP, one decoder layer, [2, 16, 64] float32: keeping the gathered inputs saves one [B, S, H] per
    region (the attention's and the MLP's, each shared by its projections); keeping the shards saves one
    [B, S/2, H] each instead: 2 · (8192 - 4096) bytes fewer. The backward all-gathers each region's shard once
    (2) beside the row-parallel layers' gradient gathers (2); each re-gathered tensor is freed once its
    projections' weight gradients are done: at the end of the backward, or with a split backward at the W pass."""
    for rank, r in enumerate(result(world4, f"layer/kv{kv}/{split}")):
        off, on = r["regather0"], r["regather1"]
        assert r["gathered_bytes"] == 8192 and r["shard_bytes"] == 4096
        assert off["saved"] - on["saved"] == 2 * (8192 - 4096), (rank, off["saved"], on["saved"])
        assert off["forward_gathers"] == on["forward_gathers"] == 2
        assert off["backward_gathers"] == 2 and on["backward_gathers"] == 4, (rank, off, on)
        # of the backward's gathered tensors, the re-gathered inputs are the ones alive beyond those without them
        regathered_alive = on["alive_after_backward"] - off["alive_after_backward"]
        if split == "zb":  # the W pass's closures hold the two re-gathered inputs until it runs
            assert regathered_alive == 2 and on["w_ran"] == off["w_ran"] > 0, (rank, off, on)
        else:
            assert regathered_alive == 0 and on["alive_after_backward"] == 0, (rank, off, on)
        assert on["alive_after_w"] == off["alive_after_w"], (rank, off, on)
        assert r["grad_rel"] <= 1e-6, (rank, r["grad_rel"])


def test_no_grad_gathers_as_before(world4):
    for r in result(world4, "no_grad"):
        assert r["gathers"] == 2 and r["equal"]


CASES = [f"tp2dp2sp/{m}" for m in ("none", "selective", "full", "kv1")]
CASES += [f"tp2pp2sp/zb-h1/{m}" for m in ("none", "selective", "full", "kv1")]


@pytest.mark.parametrize("case", CASES)
def test_equals_single_device(world4, case):
    for rank, r in enumerate(result(world4, case)):
        assert r["loss_rel"] <= LOSS_TOL, f"rank {rank} {case}: loss rel err {r['loss_rel']:.2e}"
        assert r["grad_rel_max"] <= GRAD_TOL, f"rank {rank} {case}: grad err {r['grad_rel_max']:.2e} {r['worst']}"
        assert r["logits_rel"] <= 1e-5, f"rank {rank} {case}: eval_step logits differ"
