"""plait.train under tp2·pp2 equals one device; checkpoints reshard and resume exactly; HF slices; generation."""

import pytest

import checks_train
from harness import result

# world4: tests/conftest.py (one launch of 4 ranks shared with the other world-4 modules runs checks_train)


def test_tp2_pp2_training_equals_one_device(world4):
    for rank, r in enumerate(result(world4, "train/equals_single")):
        assert len(r["got"]) == checks_train.STEPS
        assert r["rel"] <= 1e-5, f"rank {rank}: losses {r['got']} vs one device {r['ref']}"
        assert r["got"][-1] < r["got"][0], "the loss should fall"


def test_checkpoint_reshards_to_other_layouts_and_one_device(world4):
    for rank, r in enumerate(result(world4, "ckpt/reshard")):
        for name in ("tp1pp4", "tp4pp1"):
            assert r[name]["weights_rel"] == 0.0, f"rank {rank} {name}: weights differ after loading"
            for a, b in zip(r[name]["losses"], r["ref_losses"], strict=True):
                assert abs(a - b) / b <= 1e-5, f"rank {rank} {name}: continued losses {r[name]} vs {r['ref_losses']}"
        assert r["one_device_logits_rel"] <= 1e-5


@pytest.mark.parametrize("case", ["ckpt/resume", "ckpt/resume_zero1", "ckpt/resume_zero2_bf16", "ckpt/resume_zero3"])
def test_resume_is_exact(world4, case):
    for rank, r in enumerate(result(world4, case)):
        assert r["started"] == 4, f"rank {rank}: resumed at {r['started']}"
        assert r["resumed"] == r["full"], f"rank {rank}: resumed {r['resumed']} vs uninterrupted {r['full']}"


def test_zero3_training_equals_one_device(world4):
    for rank, r in enumerate(result(world4, "ckpt/resume_zero3")):
        assert len(r["gathered"]) == 4 and all(g for g in r["gathered"]), f"not run under ZeRO-3: {r['gathered']}"
        assert r["rel"] <= 1e-5, f"rank {rank}: losses {r['losses']} vs one device {r['ref']}"


def test_auto_resume_starts_fresh_then_continues_the_latest_complete_checkpoint(world4):
    for rank, r in enumerate(result(world4, "ckpt/auto_resume")):
        assert r["fresh_started"] == 1, f"rank {rank}: an empty folder should start at step 1"
        assert r["kept"] == ["step_00000002"], f"rank {rank}: --keep 2 kept {r['kept']} (step 4 was removed)"
        assert r["started"] == 3, f"rank {rank}: resumed at step {r['started']}, expected 3 (after step 2's save)"
        assert r["resumed"] == r["fresh"], f"rank {rank}: resumed {r['resumed']} vs uninterrupted {r['fresh']}"


def test_background_save_writes_the_same_bytes_as_a_save_in_the_loop(world4):
    for rank, r in enumerate(result(world4, "ckpt/async_equals_sync")):
        assert "meta.json" in r["names"] and len(r["names"]) == 5, f"rank {rank}: {r['names']}"  # 4 shards + meta
        assert r["same"], f"rank {rank}: the background save differs from the synchronous one"


def test_checkpoint_every_minutes_and_keep_all(world4):
    for rank, r in enumerate(result(world4, "ckpt/every_minutes")):
        assert r["saved"] == [f"step_0000000{s}" for s in (1, 2, 3)], f"rank {rank}: {r['saved']}"
        assert r["blocked"] == 2, f"rank {rank}: {r['blocked']} saves timed in the loop (steps 1 and 2)"


def test_hf_folder_loads_only_local_slices(world4):
    for rank, r in enumerate(result(world4, "hf/slices")):
        assert r["rel"] == 0.0
        assert r["sharded_reads"] > 0 and r["widest_fraction"] <= 0.5, f"rank {rank} read more than its half: {r}"


def test_generation_equal_across_layouts(world4):
    for rank, r in enumerate(result(world4, "generate/layouts")):
        for source in ("step_00000004", "hf"):
            greedy, sampled = r[f"{source}/single"]
            assert all(len(t) == 12 for t in greedy + sampled)
            assert greedy != sampled
            for name in ("tp2pp2", "tp1pp4", "tp4pp1"):
                got = r[f"{source}/{name}"]
                assert got == [greedy, sampled], f"rank {rank} {source} {name}: {got} vs one device"
            for name in ("tp2pp2", "tp1pp4", "tp4pp1", "single"):  # parallel models check the context too
                error = r[f"{source}/{name}/too_long"]
                assert error is not None and "exceeds the model's max_seq_len" in error, (rank, source, name, error)
        assert len(set(sum(r["hf/single"][0], []))) > 3, "random weights should give varied greedy tokens"


def test_nonfinite_loss_stops_or_skips(world4):
    for r in result(world4, "train/nonfinite"):
        assert r["stop"]["raised"] and "non-finite loss" in r["stop"]["raised"] and "step 1" in r["stop"]["raised"]
        assert r["skip"]["raised"] is None and r["skip"]["loss_finite"] is False and r["skip"]["norm"] is None


def test_moe_expert_parallel_training_and_checkpoint(world4):
    for rank, r in enumerate(result(world4, "train/moe_ep2")):
        assert r["rel"] < 1e-5, f"rank {rank}: MoE losses differ from one device by {r['rel']:.2e}"
        assert r["logits_rel"] < 1e-5, f"rank {rank}: reloaded experts give different logits"
        rows = r["rows"]
        assert [row["step"] for row in rows] == list(range(1, checks_train.STEPS + 1))
        for row in rows:  # the load-balancing loss is part of the loss; the busiest expert, per MoE layer
            assert 0 < row["aux_loss"] < row["loss"] and row["dropped_fraction"] is None, row
            assert row["expert_imbalance"] == max(row["expert_imbalance_by_layer"].values()) >= 1.0
        assert rows[0]["expert_imbalance_by_layer"] == pytest.approx(r["ref_imbalance"], rel=1e-12)
        lines = [line for line in r["log"].splitlines() if line.startswith("step ")]
        assert len(lines) == checks_train.STEPS, r["log"]
        assert all("(aux 0.0" in line and "experts max/mean" in line for line in lines), lines


def test_training_from_a_qwen2_folder_equals_one_device_and_exports_qwen2(world4):
    for rank, r in enumerate(result(world4, "train/family_qwen2")):
        assert r["rel"] <= 1e-5, f"rank {rank}: losses {r['got']} vs one device {r['ref']}"
        assert r["model_type"] == "qwen2" and r["family"] == "Qwen2"
        assert r["exported_rel"] == 0.0, f"rank {rank}: the exported folder does not hold the trained weights"
