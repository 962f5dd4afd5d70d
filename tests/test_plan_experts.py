"""The planner's two expert placements under TP (``Layout.expert_tp``, ``plan.experts``) against hand-worked
counts and the runtime's own rules and configuration."""

from dataclasses import replace

import pytest
from typer.testing import CliRunner

from plait.cli.main import app
from plait.errors import ConfigError
from plait.parallel_config import ParallelConfig
from plait.plan import Cluster, Layout, Model, Training, search
from plait.plan import experts as ex
from plait.plan.config import check
from plait.plan.gpu import ring_allgather
from plait.plan.memory import rank_params, state_bytes
from plait.plan.search import candidates

# 2 layers, h 64, MHA with 4 heads, SwiGLU f 128, vocabulary 256, 4 experts, top-2
MOE = Model(2, 64, 4, 256, 32, ffn_hidden=128, glu=True, n_experts=4, top_k=2)


def test_states_of_a_tiny_moe_at_tp2_ep2_in_both_placements():
    """Per layer: attention 4·64² = 16,384 (split: 8,192), two norms 128 and the router 64·4 = 256 (replicated
    on every TP rank), each expert 3·64·128 = 24,576; the embedding and the head 256·64 each (split: 8,192),
    the final norm 64. Dense on a GPU: 2·(8,192 + 128 + 256) + 8,192 + 8,192 + 64 = 33,600.
    Whole experts: E/ep = 2 experts, 49,152 a layer, sharded under ZeRO over dp·tp/ep = 2 ranks.
    Split: 2 experts' halves, 24,576 a layer, sharded over dp/ep = 1. bf16 ZeRO-1: 2 + 4 B held, 12 B sharded
    (the dense part over dp = 2): the same optimizer state either way."""
    whole = Layout(tp=2, dp=2, ep=2, zero=1)
    split = replace(whole, expert_tp=True)
    assert rank_params(MOE, whole, 2, True, True) == (33_600, 98_304)
    assert rank_params(MOE, split, 2, True, True) == (33_600, 49_152)
    assert (ex.dp_group(whole), ex.dp_group(split)) == (2, 1)
    assert state_bytes(MOE, whole, 2, True, True) == (2 * 131_904, 4 * 131_904, 12 * (16_800 + 49_152))
    assert state_bytes(MOE, split, 2, True, True) == (2 * 82_752, 4 * 82_752, 12 * (16_800 + 49_152))
    assert rank_params(MOE, replace(whole, tp=1, dp=4), 2, True, True)[1] == 98_304  # at tp = 1 the same
    assert rank_params(MOE, replace(split, tp=1, dp=4), 2, True, True)[1] == 98_304


def test_ep_rules_are_the_runtime_s():
    """Whole experts: EP groups are runs of ep ranks of the dp·cp·tp plane (ep = tp = 2 at dp = 1 is the TP
    group); split ones need ep | dp·cp. The messages name the parameter and the valid values, and
    ParallelConfig refuses the same layouts."""
    cluster, training = Cluster("h100-sxm", 2), Training(8)
    assert check(MOE, cluster, Layout(tp=2, ep=2), training) is None
    ParallelConfig(tp=2, dp=1, ep=2)
    key, msg = check(MOE, cluster, Layout(tp=2, ep=2, expert_tp=True), training)
    assert key == "ep" and msg.startswith("ep: 2 must divide dp·cp = 1 with expert_tp") and "valid ep: [1]" in msg
    with pytest.raises(ConfigError, match=r"^ep=2: must divide dp=1 with expert_tp=True"):
        ParallelConfig(tp=2, dp=1, ep=2, expert_tp=True)
    with pytest.raises(ConfigError, match=r"^ep=4: must divide dp=1 × cp=2 = 2 with expert_tp=True .* \[1, 2\]$"):
        ParallelConfig(tp=2, dp=1, cp=2, ep=4, expert_tp=True)
    key, msg = check(MOE, Cluster("h100-sxm", 8), Layout(tp=2, dp=4, ep=3), Training(8))
    assert key == "ep" and msg == "ep: 3 must divide n_experts = 4; valid ep: [1, 2, 4]"
    dense = replace(MOE, n_experts=1, top_k=1)
    assert check(dense, cluster, Layout(tp=2, expert_tp=True), training)[0] == "expert_tp"


def test_round_trip_with_the_runtime_s_configuration():
    """A layout's expert placement is written into the configuration the runtime runs and read back; at tp = 1
    (where the runtime drops it) it reads back unsplit."""
    for lay in (Layout(tp=2, dp=2, ep=2, expert_tp=True, sequence_parallel=True, zero=1),
                Layout(tp=2, dp=2, ep=4, zero=1)):
        par = lay.to_parallel_config(Training(8))
        assert par.expert_tp == lay.expert_tp
        assert Layout.from_parallel_config(par.resolve(lay.world), 1) == lay
    par = ParallelConfig(tp=1, dp=4, ep=2, expert_tp=True).resolve(4)
    assert Layout.from_parallel_config(par).expert_tp is False
    assert Layout(tp=2, dp=2, ep=2, expert_tp=True).short().startswith("tp2 pp1 dp2 ep2 etp ")
    assert "etp" not in Layout(tp=1, dp=2, ep=2, expert_tp=True).short()


def test_costs_of_the_two_placements():
    """The same expert FLOPs on other shapes; the all-to-all carries a TP rank's share of the tokens over ep
    consecutive ranks (whole) or all of them over ep ranks tp apart (split); whole experts' own TP collectives
    are a gather forward and an all-reduce backward (SP: a gather and a scatter) instead of the MLP's
    all-reduce each way."""
    whole = Layout(tp=2, dp=2, ep=2)
    split = replace(whole, expert_tp=True)
    flops = [sum(2 * m * n * k * c for m, n, k, c in ex.gemms(MOE, lay, 32)) for lay in (whole, split)]
    assert flops[0] == flops[1] == 2 * 32 * 2 * 3 * 64 * 128 / 2  # top-2 of the 32 tokens, half on each TP rank
    assert ex.dispatch(MOE, whole, 100.0) == (100.0, 2) and ex.dispatch(MOE, split, 100.0) == (200.0, 4)
    assert ex.tp_gathers(whole) == (1, 2) and ex.tp_gathers(split) == (2, 2)
    assert ex.tp_gathers(replace(whole, sequence_parallel=True)) == (1, 1)
    cluster = Cluster("h100-sxm", 4)
    f, b = (cluster.costs._tp_comm_per_layer(MOE, lay, 32) for lay in (replace(whole, ep=1), replace(split, ep=1)))
    gather = ring_allgather(32 * 64 * 2, 2, cluster.link(2))
    assert f[1] - f[0] == pytest.approx(gather) and f[1] == pytest.approx(b[1]) and b[0] == pytest.approx(b[1])


def test_search_weighs_both_placements_and_writes_the_planned_one(tmp_path):
    """Mixtral on 16 H100s: the search considers whole and split experts at tp > 1 (only whole at tp = 1), and
    the layout it writes carries the placement it planned."""
    model, cluster, training = Model.preset("mixtral-8x7b"), Cluster("h100-sxm", 16), Training(64)
    seen = {(lay.tp > 1, lay.expert_tp) for lay in candidates(model, cluster, training)}
    assert seen == {(False, False), (True, False), (True, True)}
    for est in search(model, cluster, training, top=5):
        assert est.layout.to_parallel_config(training).expert_tp == est.layout.expert_tp
    out = tmp_path / "best.toml"
    res = CliRunner().invoke(app, ["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--global-batch", "64",
                                   "--write-config", str(out)])
    assert res.exit_code == 0, res.output
    best = search(model, cluster, Training(64, elementwise="plait-eager"), top=1)[0].layout
    assert f"expert-tp = {str(best.expert_tp).lower()}" in out.read_text().splitlines()


@pytest.mark.parametrize("top_k,dtype", [(2, "float32"), (1, "float32"), (2, "bfloat16")])
def test_the_census_counts_what_an_moe_layer_saves(top_k, dtype):
    """What one MoE layer of the runtime (``ExpertParallelMoE``, one rank: tp1·ep1) saves for backward, as the
    runtime's meter counts it, is the census's count to the byte (plan.host.experts: its input, the router, the
    dispatch, the experts, the combine) with balanced routing (``checks_predict.balanced_route``); top-2
    renormalises the gates (two more float32 tensors), bf16 keeps the router in float32. The count of the
    experts alone as one wide MLP (the input and ``4 F``) is more than a quarter short of it."""
    from types import SimpleNamespace

    import torch

    from checks_predict import balanced_route
    from plait.experts import layer
    from plait.memory import SavedTensorMeter
    from plait.models.moe import MoE
    from plait.plan.host import census
    from plait.plan.host.experts import moe_saved

    model = replace(MOE, top_k=top_k)
    sh = census.local(model, Layout(microbatch_size=2))
    ctx = SimpleNamespace(tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, cp_size=1, expert_tp=False,
                          expert_dp_group=None, expert_dp_size=1, ep_group=None)
    torch.manual_seed(0)
    moe = layer.ExpertParallelMoE(MoE(64, 128, 4, top_k), ctx).to(getattr(torch, dtype))  # type: ignore[arg-type]
    x = torch.randn(2, 32, 64, dtype=getattr(torch, dtype), requires_grad=True)
    meter = SavedTensorMeter(moe.parameters())
    route, layer.route = layer.route, balanced_route(layer.route)  # type: ignore[assignment]
    try:
        with meter.hooks():
            y = moe(x)
    finally:
        layer.route = route
    d = x.element_size()
    assert meter.live == (sh.n + 4 * sh.f + moe_saved(sh, d)) * d
    assert census.layer_saved(sh, dtype_bytes=d) == census.layer_saved(replace(sh, experts=1), dtype_bytes=d) + \
        moe_saved(sh, d)  # a layer of the census holds it
    assert (sh.n + 4 * sh.f) * d < 0.75 * meter.live
    y.sum().backward()


def test_expert_capacity_counts_the_rows_a_gpu_s_experts_receive():
    """``Model.expert_capacity`` c: under EP a GPU's experts receive c times balanced routing's rows (at most the
    EP group's all: ep times); without EP they take every row their tokens route, whatever the routing. MOE at
    tp2·dp2·ep2, micro-batch 2 (T = 64 tokens, whole experts: a TP rank dispatches 32, A = R = 64 rows at top-2):
    the census's routed part is R·h = 4,096 input rows, 2·R int64 regroup orders (256 fp32 elements) and the
    experts' 4·R·f = 32,768; c = 1.5 adds half of it. Korthikanti's count: the MLP term 2·(f/h)·3·top_k = 24 sbh/t
    grows by half."""
    from plait.plan.host import census
    from plait.plan.memory import activation_bytes_per_layer

    layout = Layout(tp=2, dp=2, ep=2, microbatch_size=2)
    more = replace(MOE, expert_capacity=1.5)
    assert ex.received(more, layout) == 1.5 and ex.received(more, replace(layout, ep=1)) == 1.0
    assert ex.received(replace(MOE, expert_capacity=8.0), layout) == 2.0
    # at most what a GPU's experts can receive: each token's top-k rows go to distinct experts, so a GPU holding
    # one of 4 experts (ep 4) gets at most one row of every token, twice balanced routing's half a row, not 4x
    assert ex.received(replace(MOE, expert_capacity=8.0), Layout(dp=4, ep=4)) == ex.dropless_bound(MOE, Layout(
        dp=4, ep=4)) == 2.0
    mixtral = Model.preset("mixtral-8x7b")  # top-2 of 8
    assert [ex.dropless_bound(mixtral, Layout(dp=8, ep=ep)) for ep in (1, 2, 4, 8)] == [1.0, 2.0, 4.0, 4.0]
    extra = census.layer_saved(census.local(more, layout)) - census.layer_saved(census.local(MOE, layout))
    assert extra == 0.5 * (64 * 64 + 2 * 64 * 2 + 4 * 64 * 128)
    gpu_extra = activation_bytes_per_layer(more, layout) - activation_bytes_per_layer(MOE, layout)
    assert gpu_extra == pytest.approx(0.5 * 24 * 32 * 2 * 64 / 2)
    assert Model.from_llama_config({"n_experts": 4, "top_k": 2, "capacity_factor": 1.25}).expert_capacity == 1.25
    assert Model.from_llama_config({"n_experts": 4, "top_k": 2}).expert_capacity == 1.0  # dropless: balanced
    with pytest.raises(ConfigError, match="expert_capacity: must be positive"):
        replace(MOE, expert_capacity=0.0)


def test_plan_says_how_it_counts_routing_and_takes_a_capacity(tmp_path):
    """``plait plan`` of an MoE model says how routing is counted and takes ``--expert-capacity``: at 2 the
    default's best layout (tp1 dp4 ep2) keeps more activations and takes longer (its busiest GPU's experts receive
    twice the rows), so a layout without EP wins (the JSON carries the figures); 0 is refused."""
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 256, "num_attention_heads": 4,
                               "num_hidden_layers": 4, "vocab_size": 512, "intermediate_size": 512,
                               "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 512}))
    base = ["plan", "--model", str(cfg), "--gpus", "4", "--global-batch", "8", "--top", "40"]
    res = CliRunner().invoke(app, base)
    assert res.exit_code == 0, res.output
    words = " ".join(res.output.split())
    assert "MoE routing:" in words and "1× balanced routing's rows" in words
    assert ("plait routes dropless, so a step whose routing is more uneven keeps and takes more, up to 2× on the "
            "best layout (tp1 pp1 dp4 ep2 ") in words, words  # the bound it is not: top-2 of 4 experts at ep 2
    out = {}
    for c in ("1", "2"):
        res = CliRunner().invoke(app, [*base, "--expert-capacity", c, "--json"])
        assert res.exit_code == 0, res.output
        out[c] = json.loads(res.output)
    assert (out["1"]["expert_capacity"], out["2"]["expert_capacity"]) == (1.0, 2.0)
    assert out["1"]["dropless_bound"] == 2.0 and out["2"]["dropless_bound"] == 1.0  # the best at 2 has no EP
    one = out["1"]["best"][0]
    two = next(p for p in out["2"]["best"] if p["layout"] == one["layout"])  # the same layout, with EP
    assert one["layout"]["ep"] == 2 and out["2"]["best"][0]["layout"]["ep"] == 1
    assert two["memory"]["activations"] > 1.2 * one["memory"]["activations"]
    assert two["step_time_s"] > 1.2 * one["step_time_s"]
    bad = CliRunner().invoke(app, [*base, "--expert-capacity", "0"])
    assert bad.exit_code == 2 and "expert_capacity: must be positive" in bad.output


def test_the_busiest_gpu_s_expert_work_sets_the_step_time_under_ep():
    """Mixtral 8x7B at tp1 dp8 ep8 on 8 H100s (one expert a GPU, T = 4,096 tokens a micro-batch, top-2): at
    expert capacity 1.25 the busiest GPU's expert receives 1.25 × 8,192 = 10,240 rows. Its two GEMMs ([m, 2f] x
    [h] and [m, h] x [f]) run 0.25 × 2·4,096·2·3·4,096·14,336 more FLOPs each pass and move 2·2,048 rows·(h + 2f +
    f + h) more bf16 bytes; its dispatch and combine receive 1.25 times the 4,096·4,096·2 B·2 rows a GPU sends.
    Forward, backward and the W pass grow by these (backward twice: data and weight gradients), plus the fused
    element-wise traffic of its larger activation count; full recomputation redoes the larger forward. Dense
    models, and MoE layouts without EP (where a GPU's experts take its own tokens' rows), stay where they were."""
    from plait.plan.catalogue import LINK_EFFICIENCY
    from plait.plan.gpu import gemm_speed
    from plait.plan.memory import activation_bytes_per_layer
    from plait.plan.model import PRESETS

    mixtral = PRESETS["mixtral-8x7b"]
    uneven = replace(mixtral, expert_capacity=1.25)
    cluster = Cluster("h100-sxm", 8)
    costs, gpu = cluster.costs, cluster.gpu
    layout = Layout(dp=8, ep=8, recompute="selective")
    one, more = (costs.blocks(m, layout, "bf16").layer for m in (mixtral, uneven))
    flops = 0.25 * 2 * 4096 * 2 * 3 * 4096 * 14336
    traffic = 2 * 2048 * (4096 + 2 * 14336 + 14336 + 4096)
    assert more.w_compute - one.w_compute == pytest.approx(flops / gemm_speed(gpu) + traffic / gpu.memory_bandwidth)
    kept = [activation_bytes_per_layer(m, layout) for m in (mixtral, uneven)]
    elementwise = gpu.elementwise_traffic * (kept[1] - kept[0]) / gpu.memory_bandwidth
    assert more.f_compute - one.f_compute == pytest.approx(more.w_compute - one.w_compute + elementwise)
    assert more.b_compute - one.b_compute == pytest.approx(2 * (more.f_compute - one.f_compute))
    a2a = 2 * 0.25 * 4096 * 4096 * 2 * 2 * 7 / 8 / (cluster.link(8).bandwidth * LINK_EFFICIENCY)
    assert more.f_tp - one.f_tp == pytest.approx(a2a) and more.b_tp - one.b_tp == pytest.approx(a2a)
    assert one.recompute == more.recompute  # flash attention's backward recomputes the scores itself
    full = replace(layout, recompute="full")
    one_full, more_full = (costs.blocks(m, full, "bf16").layer for m in (mixtral, uneven))
    assert more_full.recompute - one_full.recompute == pytest.approx(
        more_full.f_compute - one_full.f_compute + a2a)
    assert ex.dispatch(uneven, layout, 100.0) == (250.0, 8)
    dense = replace(mixtral, n_experts=1, top_k=1)
    for m, lay in ((dense, Layout(dp=8)), (mixtral, Layout(dp=8, ep=1))):
        assert costs.blocks(replace(m, expert_capacity=1.25), lay, "bf16") == costs.blocks(m, lay, "bf16")


def test_the_host_model_charges_the_busiest_rank_s_experts():
    """plait's eager runtime on a calibrated host (``plan.host.census.layer_work``): MOE at tp2·dp2·ep2 with
    capacity 1.5 runs its three expert GEMMs (gate, up, down over F = T·top_k·f/t) and their SwiGLU kernels on
    1.5 times the rows; attention's are unchanged."""
    from plait.plan.host import census

    layout = Layout(tp=2, dp=2, ep=2, microbatch_size=2)
    one, more = (census.layer_work(census.local(m, layout), 2) for m in (MOE, replace(MOE, expert_capacity=1.5)))
    assert more.gemms[:4] == one.gemms[:4]
    assert [f for f, _ in more.gemms[4:]] == [1.5 * f for f, _ in one.gemms[4:]]
    assert more.elem_bytes - one.elem_bytes == 0.5 * census.GLU_TRAFFIC * census.local(MOE, layout).f * 2
