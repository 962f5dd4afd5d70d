"""Every schedule over TP x PP x DP (world 4 and 8) equals a single device; peaks equal the simulator's.

The world of 4 also runs the model families (Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE) from Hugging Face folders under
tp2·pp2: logits equal transformers', training equals one device, generation equals one device.
"""

import importlib.util

import pytest

import checks_families
import checks_pipeline
import checks_plan
from harness import result
from plait.schedules import SCHEDULE_NAMES

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


# families, world4: tests/conftest.py (the Hugging Face folders; one launch of 4 ranks shared with the other
# world-4 modules runs checks_pipeline with them)


# world8: tests/conftest.py (one launch of 8 ranks for these schedules and tests/test_zero.py)

WORLD4_CASES = [f"pp4/{n}" for n in SCHEDULE_NAMES] + [
    "pp4/1f1b/tied", "pp4/zbv/tied", "pp4/seq_change", "pp4/1f1b/uneven", "pp4/zb-h1/checkpointing", "pp4/gpipe/m4",
    "pp4/sequential/1f1b", "pp4/sequential/zbv", "tp2pp2sp/1f1b", "tp2pp2sp/interleaved-1f1b", "tp2pp2sp/zbv",
    "tp2pp2/zb-h1/tied", "tp2pp2sp/zbv/checkpointing", "pp2dp2/interleaved-1f1b", "pp2dp2/dualpipev",
    "pp2dp2/sequential/gpipe", "pp2dp2/unequal/sequential", "pp2dp2/unequal/llama", "pp2dp2ep2/unequal/moe",
    "pp4/zb-h1/v2", "pp4/interleaved-1f1b/m10", "pp4/interleaved-1f1b/m10/padded", "pp4/zb-h1/v2/m9",
] + [f"tp2pp2sp/{name}/{mode}" for name, mode in checks_pipeline.RECOMPUTE_CASES]
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


def test_layer_activations_under_tp_and_sp_equal_the_count(world4):
    """What a TP rank's layer keeps, with and without SP and selective recomputation (docs/runtime.md)."""
    for rank, r in enumerate(result(world4, "activations/tp2")):
        assert len(r) == 8
        for case, (got, want, cores) in r.items():
            assert got == want, f"rank {rank} {case}: saved {got} bytes, the count says {want}"
            assert cores == [case.endswith("selective")], f"rank {rank} {case}: recomputed cores {cores}"
        for kv in (4, 2):
            for sp in (0, 1):
                assert r[f"kv{kv}/sp{sp}/selective"][0] < r[f"kv{kv}/sp{sp}/none"][0]


@pytest.mark.parametrize("case", ["tp2pp2", "tp1pp1dp4", "tp2pp2ep2/moe", "tp1pp1dp4ep4/moe"])
def test_seeded_init_is_the_same_model_in_every_layout_and_bounded(world4, case):
    """One seed, one model: gathered after init, every layout equals the plain model initialised on one device;
    while building on meta, sharding and initialising, a rank holds at most its shards plus one full tensor."""
    for rank, r in enumerate(result(world4, f"init/{case}")):
        assert r["keys"] and r["equal"], f"rank {rank} {case}: weights differ from the one-device init"
        assert r["peak"] <= r["local"] + r["largest"], f"rank {rank} {case}: peak {r['peak']} bytes > shards " \
            f"{r['local']} + one full tensor {r['largest']}"
        if case.startswith("tp2pp2"):
            assert r["local"] < r["model"] / 3, f"rank {rank} {case}: holds {r['local']} of {r['model']} bytes"


def test_every_value_the_planner_emits_runs(world4):
    """The layouts of a search on 4 CPU processes (every tp, pp, dp, ep, virtual, micro-batch size, SP,
    recompute, ZeRO and schedule value it can emit, covered by a few layouts) each run one optimizer step."""
    layouts = checks_plan.covering(checks_plan.emitted(checks_plan.small_moe()))
    assert checks_plan.values(layouts) == checks_plan.values(checks_plan.emitted(checks_plan.small_moe()))
    assert len(layouts) >= 5
    for i, lay in enumerate(layouts):
        for rank, r in enumerate(result(world4, f"plan/{i}")):
            assert r["layout"] == lay.short()
            assert r["loss_rel"] <= LOSS_TOL, f"rank {rank} {lay.short()}: loss rel err {r['loss_rel']:.2e}"
            assert r["moved"], f"rank {rank} {lay.short()}: the optimizer step changed nothing"


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


FAMILIES = ["mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"]
FAMILY_CASES = [*FAMILIES, "mixtral/ep2", "mixtral/expert_tp", "qwen3_moe/ep2"]


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
@pytest.mark.parametrize("family", FAMILIES)
def test_family_export_from_tp2_pp2_shards_loads_in_transformers(world4, families, family):
    import torch
    import transformers

    result(world4, f"family/{family}")  # the export ran without error
    hf = getattr(transformers, checks_families.FAMILIES[family][1]).from_pretrained(families / f"{family}-export")
    with torch.no_grad():
        logits = hf.eval()(checks_families.tokens()[0]).logits
    assert (logits - torch.load(families / family / "ref.pt")).abs().max() <= 1e-5


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (pip install -e .[dev])")
@pytest.mark.parametrize("family", FAMILIES)
def test_family_generate_tp2_pp2_equals_one_device(world4, family):
    for rank, r in enumerate(result(world4, f"family/{family}/generate")):
        assert r["parallel"] == r["single"], f"rank {rank} {family}: {r['parallel']} vs one device {r['single']}"
        assert len(r["single"][0][0]) == 7


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (pip install -e .[dev])")
@pytest.mark.parametrize("family", FAMILIES)
def test_family_serve_paged_kv_tp2_pp2_equals_one_device(world4, family):
    for rank, r in enumerate(result(world4, f"family/{family}/generate")):
        r = r["serve"]
        assert r["parallel"] == r["single"], f"rank {rank} {family}: {r['parallel']} vs one device {r['single']}"
        assert [len(t) for t in r["single"]] == [7, 7, 7]
