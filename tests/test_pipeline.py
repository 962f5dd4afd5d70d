"""Every schedule over TP x PP x DP (world 4 and 8) equals a single device; peaks equal the simulator's.

The world of 4 also runs the model families (Mistral, Qwen2, Qwen3, Mixtral) from Hugging Face folders under
tp2·pp2: logits equal transformers', training equals one device, generation equals one device.
"""

import importlib.util

import pytest

import checks_families
import checks_pipeline
from harness import launch, result
from plait.schedules import SCHEDULE_NAMES

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    return checks_families.make_folders(tmp_path_factory.mktemp("families")) if HAS_TRANSFORMERS else None


@pytest.fixture(scope="module")
def world4(families):
    return launch(checks_pipeline.rank_main, 4, None if families is None else str(families))


# world8: tests/conftest.py (one launch of 8 ranks for these schedules and tests/test_zero.py)

WORLD4_CASES = [f"pp4/{n}" for n in SCHEDULE_NAMES] + [
    "pp4/1f1b/tied", "pp4/zbv/tied", "pp4/seq_change", "pp4/1f1b/uneven", "pp4/zb-h1/checkpointing", "pp4/gpipe/m4",
    "pp4/sequential/1f1b", "pp4/sequential/zbv", "tp2pp2sp/1f1b", "tp2pp2sp/interleaved-1f1b", "tp2pp2sp/zbv",
    "tp2pp2/zb-h1/tied", "tp2pp2sp/zbv/checkpointing", "pp2dp2/interleaved-1f1b", "pp2dp2/dualpipev",
    "pp2dp2/sequential/gpipe", "pp2dp2/unequal/sequential", "pp2dp2/unequal/llama", "pp2dp2ep2/unequal/moe",
    "pp4/zb-h1/v2", "pp4/interleaved-1f1b/m10", "pp4/interleaved-1f1b/m10/padded", "pp4/zb-h1/v2/m9",
]
WORLD8_CASES = [f"tp2pp2dp2/{n}" for n in ("zbv", "1f1b", "interleaved-1f1b", "dualpipev")]


def _assert_equal(world, case):
    for rank, r in enumerate(result(world, case)):
        assert r["loss_rel"] <= LOSS_TOL, f"rank {rank} {case}: loss rel err {r['loss_rel']:.2e}"
        assert r["grad_rel_max"] <= GRAD_TOL, f"rank {rank} {case}: grad err {r['grad_rel_max']:.2e} {r['worst']}"
        assert r["peak_measured"] == pytest.approx(r["peak_sim"]), (
            f"rank {rank} {case}: held {r['peak_measured']} micro-batches, simulator says {r['peak_sim']}")
        if "peak_sends" in r:  # send buffers are freed as soon as the peer has them, not at the end of the step
            bound = 2 * r["peak_sim"] * r["virtual"] + 2  # one activation and one gradient per held chunk, + header
            assert r["peak_sends"] <= bound, f"rank {rank} {case}: {r['peak_sends']} send buffers alive (> {bound})"
        if "logits_rel" in r:
            assert r["logits_rel"] <= 1e-5, f"rank {rank} {case}: eval_step logits differ"


@pytest.mark.parametrize("case", WORLD4_CASES)
def test_world4_equals_single_device(world4, case):
    _assert_equal(world4, case)


@pytest.mark.parametrize("case", WORLD8_CASES)
def test_world8_tp2_pp2_dp2(world8, case):
    _assert_equal(world8, case)


def test_rounds_of_interleaved_schedules_ran(world4):
    # the runtime ran the rounds it was given: equal (PyTorch's), padded (Megatron's), unequal equal-ish
    assert result(world4, "pp4/interleaved-1f1b/m10")[0]["round_widths"] == [5, 5]
    assert result(world4, "pp4/interleaved-1f1b/m10/padded")[0]["round_widths"] == [4, 4, 2]
    assert result(world4, "pp4/zb-h1/v2/m9")[0]["round_widths"] == [5, 4]
    assert result(world4, "pp4/zb-h1/v2")[0]["virtual"] == 2


def test_uneven_partition_is_used(world4):
    assert result(world4, "pp4/1f1b/uneven")[0]["partition"] == [1, 3, 2, 2]
    assert sum(result(world4, "pp4/1f1b")[0]["partition"]) == 8


@pytest.mark.parametrize("case,needle", [
    ("bad/batch_not_divisible", "microbatches"),
    ("bad/too_few_layers", "layers"),
    ("bad/unknown_schedule", "schedule"),
    ("bad/microbatches_zero", "microbatches"),
])
def test_bad_pipeline_input_is_config_error_everywhere(world4, case, needle):
    for rank, r in enumerate(result(world4, case)):
        assert r["raised"] == "ConfigError", f"rank {rank}: {r}"
        assert needle in r["message"], r["message"]


@pytest.mark.parametrize("case", ["trace/1f1b", "trace/zbv", "trace/zb-h1/v2"])
def test_measured_timeline_is_the_schedule(world4, case):
    for rank, r in enumerate(result(world4, case)):
        assert r["order_ok"], f"rank {rank}: the runtime did not run the schedule's actions in order"
        assert r["times_ok"]
        assert r["n_events"] == r["n_actions"], "the Chrome trace lacks actions"
        assert r["costs_positive"]
        assert "simulated with measured costs" in r["text"] and "bubble: measured" in r["text"]


@pytest.mark.parametrize("case", ["tp2pp2sp/zbv/meta", "pp4/1f1b/meta"])
def test_model_built_on_meta_device(world4, case):
    _assert_equal(world4, case)
    for rank, r in enumerate(result(world4, case)):
        assert not r["any_meta"], f"rank {rank}: a parameter was left on the meta device"
        assert r["local_fraction"] < 0.5, f"rank {rank} holds {r['local_fraction']:.0%} of the model"


FAMILY_CASES = ["mistral", "qwen2", "qwen3", "mixtral", "mixtral/ep2", "mixtral/expert_tp"]


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (pip install -e .[dev])")
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_family_tp2_pp2_sp_equals_transformers_and_one_device(world4, case):
    for rank, r in enumerate(result(world4, f"family/{case}")):
        assert r["family"] == case.split("/")[0]
        assert r["n_grads"] > 30
        assert r["plain_max_abs"] <= 1e-5, f"rank {rank} {case}: one-device logits differ from transformers"
        assert r["logits_max_abs"] <= 1e-5, f"rank {rank} {case}: tp2·pp2 logits differ from transformers"
        assert r["loss_rel"] <= LOSS_TOL, f"rank {rank} {case}: loss rel err {r['loss_rel']:.2e}"
        assert r["grad_rel_max"] <= GRAD_TOL, f"rank {rank} {case}: grad err {r['grad_rel_max']:.2e} {r['worst']}"


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (pip install -e .[dev])")
@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "mixtral"])
def test_family_export_from_tp2_pp2_shards_loads_in_transformers(world4, families, family):
    import torch
    import transformers

    result(world4, f"family/{family}")  # the export ran without error
    hf = getattr(transformers, checks_families.FAMILIES[family][1]).from_pretrained(families / f"{family}-export")
    with torch.no_grad():
        logits = hf.eval()(checks_families.tokens()[0]).logits
    assert (logits - torch.load(families / family / "ref.pt")).abs().max() <= 1e-5


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (pip install -e .[dev])")
@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "mixtral"])
def test_family_generate_tp2_pp2_equals_one_device(world4, family):
    for rank, r in enumerate(result(world4, f"family/{family}/generate")):
        assert r["parallel"] == r["single"], f"rank {rank} {family}: {r['parallel']} vs one device {r['single']}"
        assert len(r["single"][0][0]) == 7
