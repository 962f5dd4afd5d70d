"""ZeRO-3 (parameters sharded over data parallelism, with or without a pipeline, one chunk a rank or two) in the
shared world of 4 (checks_zero3): 5 clipped AdamW steps equal one device; the bytes held between steps are
1/(tp·dp) of the model (of the stage under a pipeline) up to each bucket's padding; the gathered working set is two
neighbouring blocks of one chunk under every schedule; exact resume; checkpoints across layouts."""

import pytest

from checks_optim import cfg_for
from harness import result
from test_optim import BF16_LOSS_TOL, BF16_NORM_TOL, BF16_PARAM_TOL, NORM_TOL, PARAM_TOL

PIPELINE = ["pp2dp2", "pp2dp2/gpipe/full/tied", "pp2dp2/interleaved", "pp2dp2/looped-bfs/full/tied"]
FP32 = ["dp4", "tp2dp2/sp", "dp4/selective", "dp4/full/tied", "tp2dp2ep2/moe", *PIPELINE]
BF16 = ["dp4/bf16", "pp2dp2/bf16/selective", "pp2dp2/interleaved/bf16/selective"]

# world4: tests/conftest.py (one launch of 4 ranks shared with the other world-4 modules runs checks_zero3)


@pytest.mark.parametrize("case", FP32)
def test_zero3_equals_single_device(world4, case):
    for rank, r in enumerate(result(world4, case)):
        assert min(r["ref_norms"]) > 0.05, f"clipping was not active: norms {r['ref_norms']}"
        assert r["norm_rel_max"] <= NORM_TOL, f"rank {rank} {case}: norm rel err {r['norm_rel_max']:.2e}"
        assert r["param_rel_max"] <= PARAM_TOL, f"rank {rank} {case}: param rel err {r['param_rel_max']:.2e} " \
                                                f"at {r['worst']}"
        assert r["loss_rel_max"] <= 1e-5, f"rank {rank} {case}: loss rel err {r['loss_rel_max']:.2e}"
        assert r["pad_zero"] in (None, True), f"rank {rank} {case}: padded vocabulary rows moved"


@pytest.mark.parametrize("case", BF16)
def test_zero3_bf16_tracks_fp32(world4, case):
    for rank, r in enumerate(result(world4, case)):
        assert 1e-5 < r["loss_rel_max"] <= BF16_LOSS_TOL, f"rank {rank}: losses {r['losses']}"
        assert r["norm_rel_max"] <= BF16_NORM_TOL, f"rank {rank}: norms {r['norm_rel_max']:.2e}"
        assert r["param_rel_max"] <= BF16_PARAM_TOL, f"rank {rank}: params {r['param_rel_max']:.2e}"
        if case == "dp4/bf16":
            assert r["memory"]["params_gathered_peak"] * 2 == result(world4, "dp4")[rank]["pair_max"]  # bf16 gathers


@pytest.mark.parametrize("case", FP32 + BF16)
def test_measured_bytes_equal_the_formula(world4, case):
    """Parameters, gradients and optimizer state measured after the steps equal docs/optim.md's ZeRO-3 formula:
    4 B per shard element of parameters (the float32 masters) and of gradients, 8 B per owned element of moments."""
    for rank, r in enumerate(result(world4, case)):
        for key in ("params", "grads", "optimizer"):
            assert r["memory"][key] == r["formula"][key], f"rank {rank} {case} {key}: {r['memory']} vs {r['formula']}"


@pytest.mark.parametrize("case,tp,dp", [("dp4", 1, 4), ("tp2dp2/sp", 2, 2)])
def test_parameters_held_between_steps_are_one_over_tp_dp(world4, case, tp, dp):
    """Between steps a rank holds 1/dp of its TP shard of every parameter (float32, nothing gathered), so the
    world holds each element once per TP replica; the gathered working set of a step is the largest two
    neighbouring blocks (the one computing and the one prefetched), far below the model."""
    rows = result(world4, case)
    for r in rows:
        assert r["gathered_now"] == 0
        held, local = r["memory"]["params"], 4 * r["local_params"]
        assert local / dp <= held <= local / dp + 4 * dp * r["n_param_buckets"], (held, local)
        assert r["memory"]["params_gathered_peak"] == r["pair_max"] < local / 2
        if tp == 1:  # the planner counts the same blocks (plan.memory.zero3_working)
            assert r["planned_gathered"] == r["pair_max"], (r["planned_gathered"], r["pair_max"])
    if tp == 1:  # the model's elements exactly once over the DP ranks, up to the padding of each bucket
        assert 4 * r["model_params"] <= sum(x["memory"]["params"] for x in rows) <= 4 * (r["model_params"] +
                                                                                        dp * r["n_param_buckets"])


@pytest.mark.parametrize("case", PIPELINE)
def test_a_pipeline_stage_holds_one_over_dp_of_its_parameters(world4, case):
    """pp2·dp2: between steps a rank holds 1/dp of its stage's parameters (nothing gathered), the DP pair of a stage
    holds each of its elements once, and the two stages together the model (tied copies twice). The gathered
    working set is the largest two neighbouring blocks of one chunk, under every schedule: a chunk's last block is
    not kept while other forwards run (1f1b's warm-up, gpipe's forwards, the other chunk's under interleaved-1f1b
    and looped-bfs), and prefetches stay inside a chunk; the planner counts the same (plan.memory.zero3_working)."""
    rows = result(world4, case)
    for rank, r in enumerate(rows):
        assert r["gathered_now"] == 0
        held, local = r["memory"]["params"], 4 * r["local_params"]
        assert local / 2 <= held <= local / 2 + 4 * 2 * r["n_param_buckets"], (rank, held, local)
        assert r["memory"]["params_gathered_peak"] == r["pair_max"] < local, (rank, r["memory"], r["pair_max"])
        assert r["planned_gathered"] == r["pair_max"], (rank, r["planned_gathered"])  # what plait plan counts
    stage_params = {r["pp_rank"]: r["local_params"] for r in rows}
    cfg = cfg_for()
    tied_copy = cfg.vocab_size * cfg.dim if "tied" in case else 0  # the head's copy of the embedding
    assert sum(stage_params.values()) == rows[0]["model_params"] + tied_copy, stage_params


def test_gradients_reduced_per_block_and_micro_batch(world4):
    """Each micro-batch's backward reduce-scatters every block as soon as its gradients are complete, straight from
    ``.grad``: when a reduction starts only that block's gradients are whole (FSDP2's bound, never full gradients
    of several blocks or micro-batches)."""
    for rank, r in enumerate(result(world4, "dp4/grads-at-launch")):
        assert r["launches"] == r["expected"], (rank, r)
        assert r["others_max"] == 0 and r["own_complete"], (rank, r)


def test_a_parameter_no_forward_uses(world4):
    for rank, r in enumerate(result(world4, "dp4/unused-parameter")):
        assert r["spare_zero"] and r["rel_max"] <= PARAM_TOL, (rank, r)


def test_resume_is_exact(world4):
    for rank, r in enumerate(result(world4, "tp2dp2/sp/resume")):
        assert r["identical"] and r["steps"] == 5 and r["param_rel_max"] <= PARAM_TOL, (rank, r)


def test_checkpoint_round_trip_and_other_layout(world4):
    for rank, r in enumerate(result(world4, "dp4/checkpoint")):
        assert r["same_model"] and r["same_optim"], (rank, r)


@pytest.mark.parametrize("case", ["tp2dp2->tp2pp2", "pp2dp2->dp4/zero1", "dp4/zero1->pp2dp2",
                                  "pp2dp2/interleaved->dp4/zero1", "dp4/zero1->pp2dp2/interleaved"])
def test_checkpoint_resumed_under_another_layout(world4, case):
    """A checkpoint of 3 steps loaded under another layout and ZeRO stage (ZeRO-3 tp2·dp2 into tp2·pp2 ZeRO-0;
    ZeRO-3 pp2·dp2 under 1f1b or interleaved-1f1b into pp1 dp4 ZeRO-1, and back): the tensors loaded are the saved
    run's, bit for bit, and 2 more steps there equal one device."""
    for rank, r in enumerate(result(world4, case)):
        assert r["loaded_equal"], f"rank {rank} {case}: loaded other tensors than the saved run held"
        assert r["param_rel_max"] <= PARAM_TOL, (rank, r)


def test_plain_torch_optimizers_over_parameters_equal_one_device(world4):
    """``torch.optim.SGD`` / ``AdamW`` over ``pm.parameters()`` (the float32 shards with their reduced gradient
    shards) train as one device does, 3 steps under tp2·dp2."""
    for rank, r in enumerate(result(world4, "tp2dp2/plain-optimizers")):
        for name in ("sgd", "adamw"):
            assert r[name]["moved"], f"rank {rank} {name}: some weight did not change"
            assert r[name]["loss_rel_max"] <= 1e-5, (rank, name, r[name])
            assert r[name]["param_rel_max"] <= PARAM_TOL, (rank, name, r[name])


def test_a_torch_optimizer_over_named_parameters_is_refused_naming_the_fix(world4):
    """The float32 bucket shards an optimizer steps hold slices of several parameters: ``pm.named_parameters()``
    under zero=3 is a ConfigError pointing to ``pm.parameters()``, not the whole parameters (empty between steps:
    an optimizer over them would step nothing)."""
    for r in result(world4, "tp2dp2/plain-optimizers"):
        assert "named_parameters() under zero=3" in r["named"] and "pm.parameters()" in r["named"], r["named"]


def test_named_parameters_in_one_process():
    """zero=3 on one rank: named_parameters() refuses before anything runs, named_model_parameters() lists the plain
    model's parameters, and ParallelOptimizer (which names its pieces by them) builds; without ZeRO-3
    named_parameters() names exactly what parameters() yields."""
    import torch

    import plait
    from plait.models import Llama
    from plait.optim import ParallelOptimizer

    names = [n for n, _ in Llama(cfg_for()).named_parameters()]
    with plait.init(1, 1, 1) as ctx:
        pm = plait.parallelize(Llama(cfg_for()), ctx, zero=3)
        with pytest.raises(plait.ConfigError, match=r"Pass pm\.parameters\(\) to a torch optimizer"):
            torch.optim.AdamW(pm.named_parameters(), lr=1e-3)
        assert [n for n, _ in pm.named_model_parameters()] == names
        opt = ParallelOptimizer(pm, zero=3)
        assert {pc.name for pc in opt.layout.pieces} == set(names)
        plain = plait.parallelize(Llama(cfg_for()), ctx)
        assert [n for n, _ in plain.named_parameters()] == names
        assert [p for _, p in plain.named_parameters()] == list(plain.parameters())


def test_refusals_say_why_and_what_instead(world4):
    r = result(world4, "refusals")[0]
    for name in ("zbv", "zb-h1"):
        assert f"schedule='{name}'" in r[name] and "zero=3" in r[name] and "splits backwards" in r[name], r[name]
        assert "valid schedules with zero=3: 1f1b, gpipe, interleaved-1f1b, looped-bfs" in r[name], r[name]
    for name in ("opt3", "opt1"):
        assert "plait.parallelize(model, ctx, zero=3)" in r[name], r[name]


def test_verify_rank_side_under_zero3(world4):
    """``plait verify --tp 2 --dp 2 --pp 1 --zero 3``: gradients gathered from their shards equal one device."""
    rows = result(world4, "verify")
    assert rows[0]["ok"] is True and rows[0]["worst"] <= PARAM_TOL, rows[0]
