"""Context parallelism: the layout dimension cp (configuration, mesh order, groups), and a Llama under cp with
TP+SP, PP schedules, DP, EP, recomputation, ZeRO and bf16 equal to one device in both K/V exchange modes."""

from __future__ import annotations

import pytest

from checks_context import CASES, MESHES, model_config
from harness import result
from plait.errors import ConfigError
from plait.parallel_config import ParallelConfig

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # parallel equals single device within float32 rounding
# bf16 weights and activations vs the fp32 single device, one step (measured on this CPU: loss 1e-5 to 4e-5,
# gradients 1.5e-2 to 1.7e-2, logits 6e-3 to 7e-3 relative); tolerances about 3x those
BF16_LOSS_TOL, BF16_GRAD_TOL, BF16_LOGITS_TOL = 1e-4, 5e-2, 2e-2

# world4: tests/conftest.py (one launch of 4 ranks shared with the other world-4 modules runs checks_context)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_mesh_order_tp_innermost_then_cp_dp_pp(world4, name):
    rows = result(world4, f"mesh/{name}")
    assert sorted(r["coords"] for r in rows) == sorted({r["coords"] for r in rows}), "two ranks share coordinates"
    for r in rows:
        assert r["formula"] == r["rank"], r
        assert r["cp_group_ok"] and r["dp_cp_group_ok"] and r["pp_peer_ok"], r


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_gradients_and_logits_equal_one_device(world4, case):
    for rank, r in enumerate(result(world4, f"equal/{case}")):
        assert r["n_grads"] >= 38
        assert r["loss_rel"] <= LOSS_TOL, f"rank {rank} {case}: loss rel err {r['loss_rel']:.2e}"
        assert r["grad_rel_max"] <= GRAD_TOL, f"rank {rank} {case}: {r['worst_grad']} rel err {r['grad_rel_max']:.2e}"
        assert r["logits_rel"] <= LOSS_TOL, f"rank {rank} {case}: eval logits rel err {r['logits_rel']:.2e}"


@pytest.mark.parametrize("comm", ["allgather", "ring"])
def test_bf16_within_tolerance(world4, comm):
    for rank, r in enumerate(result(world4, f"bf16/{comm}")):
        assert r["loss_rel"] <= BF16_LOSS_TOL and r["logits_rel"] <= BF16_LOGITS_TOL, (rank, r)
        assert r["grad_rel_max"] <= BF16_GRAD_TOL, (rank, r)
        assert r["grad_rel_max"] > GRAD_TOL, f"rank {rank}: bf16 gradients equal fp32: the cast did not happen"


@pytest.mark.parametrize("case", ["zero1/allgather", "zero2/ring"])
def test_zero_optimizer_steps_equal_one_device(world4, case):
    for rank, r in enumerate(result(world4, case)):
        assert r["param_rel_max"] <= 1e-4, f"rank {rank} {case}: params after 5 steps {r['param_rel_max']:.2e}"
        assert r["norm_rel_max"] <= 1e-5 and r["loss_rel_max"] <= 1e-5, (rank, r["norm_rel_max"], r["loss_rel_max"])
        assert r["miscount_rel"] == 0.0  # each rank owns a different shard: no gradient element counted twice


@pytest.mark.parametrize("comm", ["allgather", "ring"])
def test_activation_bytes_fall_as_one_over_cp(world4, comm):
    """One row of 64 tokens per CP group: the ring keeps 1/cp of one device's saved bytes and the output
    projection's own copy of the core's output (one device's SDPA output is that projection's input; plait's
    CP core keeps its float32 output apart), [S/cp, h] a layer; the all-gather keeps the other ranks' keys and
    values per layer instead of its own, (1 - 1/cp) of the whole sequence's."""
    peak = {cp: result(world4, f"activations/cp{cp}/{comm}") for cp in (1, 2, 4)}
    ring = {cp: result(world4, f"activations/cp{cp}/ring") for cp in (1, 2, 4)}
    cfg = model_config(max_seq_len=64)
    kv_bytes = cfg.n_layers * 2 * 64 * cfg.n_kv_heads * cfg.head_dim * 4  # K and V [B=1, h_kv, S, hd], fp32
    for rank in range(4):
        one = peak[1][rank]
        for cp in (2, 4):
            if comm == "ring":
                out_copy = cfg.n_layers * (64 // cp) * cfg.n_heads * cfg.head_dim * 4  # fp32
                assert abs((peak[cp][rank] - out_copy) / one - 1 / cp) <= 0.02 / cp, (cp, peak[cp][rank], one)
            else:
                extra = kv_bytes * (cp - 1) // cp
                assert peak[cp][rank] - ring[cp][rank] == extra, (cp, peak[cp][rank], ring[cp][rank], extra)


@pytest.mark.parametrize("kv_heads,precision,cps", [(2, "fp32", (2, 4)), (4, "fp32", (2, 4)), (1, "fp32", (2, 4)),
                                                    (2, "bf16", (1, 2, 4))])
@pytest.mark.parametrize("comm", ["allgather", "ring"])
def test_planner_predicts_the_bytes_cp_saves(world4, comm, kv_heads, precision, cps):
    """The planner's count of what autograd saves (``plait.plan.host.costs.eager_activations``, plait's runtime
    tensor by tensor) is what every rank's meter measured under cp2·dp2 and cp4, with grouped, multi-head and
    single-KV-head attention, in fp32 and bf16 (one row of 64 tokens per CP group). Within 0.1%: the meter
    counts a few bytes the census leaves out (8 bytes in ~10^5 here)."""
    from plait.plan import Layout, Model
    from plait.plan.host.costs import eager_activations

    cfg = model_config(max_seq_len=64, n_kv_heads=kv_heads)
    model = Model.from_llama_config(cfg.to_dict(), 64)
    for cp in cps:
        if cp == 1 and comm == "ring":
            continue  # cp1 exchanges nothing: its check runs once, under the all-gather's name
        name = f"activations/cp{cp}/{comm}" + ("" if kv_heads == 2 else f"/kv{kv_heads}")
        name += "/bf16" if precision == "bf16" else ""
        par = ParallelConfig(cp=cp, dp=4 // cp, cp_comm=comm, precision=precision).resolve(4)
        acts = eager_activations(model, Layout.from_parallel_config(par, 1), precision)
        predicted = acts.chunk(model.n_layers, True, True) + acts.shared  # the RoPE tables once per rank
        for rank, measured in enumerate(result(world4, name)):
            assert measured == pytest.approx(predicted, rel=1e-3), (name, rank, measured, predicted)


@pytest.mark.parametrize("case,needles", [
    ("bad_seq_len", ["cp=2", "seq_len=6", "multiple of 4", "valid lengths"]),
    ("bad_loss_fn", ["cp=2", "loss_fn"]),
    ("bad_capacity", ["cp=2", "capacity_factor", "None"]),
    ("bad_generate", ["cp=2", "cp=1"]),
])
def test_bad_input_is_a_config_error_on_every_rank(world4, case, needles):
    for message in result(world4, f"bad/{case}"):
        assert message.startswith("ConfigError"), message
        for needle in needles:
            assert needle in message, message


@pytest.mark.parametrize("seq,cp", [(64, 2), (4096, 4), (96, 3), (128, 8)])
def test_zigzag_layout_balances_causal_attention_work(seq, cp):
    """Each rank's attention work — the query-key pairs its causal mask keeps, counted with the runtime's own
    positions and mask — is within 1% of every other rank's; a contiguous cut would not be."""
    from plait.context_parallel import attention_pairs, local_positions

    pairs = attention_pairs(seq, cp)
    assert sum(pairs) == seq * (seq + 1) // 2  # every pair of the causal mask, each counted once
    assert max(pairs) <= 1.01 * min(pairs), pairs
    held = sorted(int(p) for r in range(cp) for p in local_positions(seq // cp, cp, r))
    assert held == list(range(seq))  # the ranks' chunks tile the sequence
    contiguous = [sum(range(r * seq // cp + 1, (r + 1) * seq // cp + 1)) for r in range(cp)]
    assert max(contiguous) > 1.5 * min(contiguous)  # what the zigzag avoids


def test_cp_one_keeps_every_rank_formula():
    cfg = ParallelConfig(tp=2, pp=2).resolve(8)
    assert (cfg.cp, cfg.dp, cfg.world) == (1, 2, 8)
    assert ParallelConfig(tp=2, cp=2, pp=2).resolve(16).dp == 2


@pytest.mark.parametrize("kw,world,needles", [
    (dict(cp=0), None, ["cp=0", "positive"]),
    (dict(cp_comm="p2p"), None, ["cp_comm='p2p'", "allgather, ring"]),
    (dict(tp=2, cp=3), 8, ["tp*cp*pp=2*3*1=6", "world size 8"]),
    (dict(tp=2, cp=2, dp=4), 8, ["tp*cp*pp*dp", "world size is 8"]),
    (dict(cp=2, dp=1, ep=4), None, ["ep=4", "dp*cp*tp=2"]),
    (dict(tp=2, cp=2, dp=1, ep=4, expert_tp=True), None, ["ep=4", "dp=1 × cp=2 = 2", "expert_tp"]),
])
def test_bad_cp_is_a_config_error_naming_it(kw, world, needles):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**kw).resolve(world) if world else ParallelConfig(**kw)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize("kw,seq,needles", [
    (dict(cp=2), 18, ["seq_len=18: must be a multiple of 4 under cp=2", "the nearest 16 or 20"]),
    (dict(cp=2, tp=4, sequence_parallel=True), 12, ["cp=2", "multiple of 8", "sequence parallelism",
                                                    "the nearest 8 or 16"]),
    (dict(cp=4), 6, ["multiple of 8", "valid lengths: 8, 16, 24, ..., the nearest 8"]),
])
def test_sequence_length_is_checked_against_cp(kw, seq, needles):
    ParallelConfig(**kw).check_seq_len(seq * 4)  # a multiple is fine
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**kw).check_seq_len(seq)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_train_under_cp_equals_one_device_resumes_exactly_and_loads_under_tp2(world4):
    """plait train under cp2·dp2 (ring, ZeRO-1): losses of one device; its checkpoint loads under tp2·dp2 with the
    same weights and logits; a run resumed from its step-3 checkpoint continues exactly (all-gather), and under
    cp4 (ring) it continues within float32 rounding (its sums run in another order)."""
    for rank, r in enumerate(result(world4, "train/checkpoints")):
        assert r["rel"] <= LOSS_TOL, f"rank {rank}: losses {r['got']} vs one device {r['ref']}"
        assert r["tp2_weights_rel"] == 0.0, f"rank {rank}: tp2 loaded other weights ({r['tp2_weights_rel']:.2e})"
        assert r["tp2_logits_rel"] <= LOSS_TOL, f"rank {rank}: tp2 logits {r['tp2_logits_rel']:.2e}"
        assert r["started"] == 4 and r["resumed"] == r["full"], f"rank {rank}: {r['resumed']} vs {r['full']}"
        assert r["cp4_resumed"] == pytest.approx(r["full"], rel=LOSS_TOL), (rank, r["cp4_resumed"], r["full"])


def test_planner_recommends_and_writes_cp_where_the_sequence_demands_it(tmp_path):
    """Llama-3 8B at 128k tokens on 16 H100s: the best layout splits the sequence (runnable, both K/V exchanges
    searched), ``plait plan --write-config`` writes its cp for ``plait train --config``; the all-gather keeps
    the other ranks' K/V, the ring does not."""
    import tomllib
    from typer.testing import CliRunner

    from plait.cli.main import app
    from plait.plan import Cluster, Layout, Model, Training, search
    from plait.plan.memory import activation_bytes_per_layer

    model, cluster = Model.preset("llama3-8b", 131072), Cluster("h100-sxm", 16)
    training = Training(16, masters="plait")  # as plait plan plans a run of plait's
    best = search(model, cluster, training, top=3).best
    assert best[0].layout.cp > 1 and all(e.layout.runnable for e in best), [e.layout.short() for e in best]
    cfg = best[0].layout.to_parallel_config(training)
    assert (cfg.cp, cfg.cp_comm) == (best[0].layout.cp, best[0].layout.cp_comm)
    out = tmp_path / "plan.toml"
    res = CliRunner().invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "16", "--seq-len", "131072",
                                   "--global-batch", "16", "--write-config", str(out)])
    assert res.exit_code == 0, res.output
    assert tomllib.loads(out.read_text())["cp"] == best[0].layout.cp
    ring, gather = (activation_bytes_per_layer(model, Layout(tp=2, cp=8, cp_comm=c)) for c in ("ring", "allgather"))
    kv = model.kv_heads * model.head_dim
    assert gather - ring == pytest.approx(2 * 2 * (8 - 1) * model.seq_len / 8 * kv / 2)  # bf16 K and V of 7 ranks
    one = activation_bytes_per_layer(model, Layout(tp=2, cp=1, recompute="selective"))
    assert ring == pytest.approx(one / 8)  # a rank's S/cp tokens, nothing kept of the scores


def test_planner_recomputes_nothing_for_selective_under_cp():
    """Context parallelism's core replaces selective recomputation's checkpointed core (it keeps no
    probabilities), so the planner's layer under cp recomputes nothing and saves what recompute none saves, on a
    calibrated host and on a GPU without fused attention; at cp1 selective recomputation costs time."""
    from dataclasses import replace

    from plait.plan import Cluster, Layout, Model
    from profile_util import synthetic_profile

    model = Model.from_llama_config(model_config(max_seq_len=256).to_dict(), 256)
    for cluster in (Cluster.from_profile(synthetic_profile(), 4), Cluster("h100-sxm", 4, flash_attention=False)):
        for cp in (1, 2, 4):
            layout = Layout(cp=cp, dp=4 // cp, recompute="selective")
            layer = cluster.costs.blocks(model, layout, "fp32").layer
            assert (layer.recompute > 0) == (cp == 1), (cluster.gpu, cp, layer)
            none = cluster.costs.activations(model, replace(layout, recompute="none"), "fp32").layer
            assert (cluster.costs.activations(model, layout, "fp32").layer == none) == (cp > 1), (cluster.gpu, cp)


def test_planner_counts_a_sliding_window_as_plait_attends_with_it():
    """Mistral's window: at cp1 plait's layer hands SDPA an explicit mask, which its flash backend does not take
    (the whole square is computed, twice the causal half); CP's blockwise attention skips the blocks outside the
    window, so under cp the planner's attention core shrinks to the pairs the runtime's mask keeps."""
    from dataclasses import replace

    from plait.context_parallel import attention_pairs
    from plait.plan import Cluster, Layout, Model
    from plait.plan.attention import DEFAULT_KERNEL, efficiency, window_share

    for seq, window in ((4096, 1000), (1024, 1024), (64, 5), (64, 100)):
        pairs = sum(attention_pairs(seq, 1, window))
        assert window_share(seq, window) == pytest.approx(pairs / (seq * (seq + 1) / 2), rel=1e-12), (seq, window)
    seq, window = 32768, 4096
    full = Model.preset("llama3-8b", seq)
    windowed, cluster = replace(full, sliding_window=window), Cluster("h100-sxm", 8)
    for cp in (1, 4):
        layout = Layout(cp=cp, dp=8 // cp)
        kernel = efficiency(cluster.gpu, DEFAULT_KERNEL, seq / cp, full.head_dim)
        causal = 4 * seq / cp * seq * full.q_width / 2 / (cluster.gpu.peak_flops * kernel)  # the causal half
        f_full, f_window = (cluster.costs.blocks(m, layout, "bf16").layer.f_compute for m in (full, windowed))
        expected = causal if cp == 1 else -causal * (1 - window_share(seq, window))
        assert f_window - f_full == pytest.approx(expected, rel=1e-6), (cp, f_window, f_full)


def test_planner_searches_cp_for_a_sliding_window_below_the_long_sequence_threshold():
    """A windowed Llama-3 8B at 16k tokens on 4 H100s (on 2, with the loss's backward counted, no layout fits):
    cp1 attends behind a mask (the whole square, the mask kept per layer), CP skips what the window leaves out; the
    search weighs CP below CP_MIN_SEQ_LEN for such a model and recommends it, and does not say it was not searched.
    Without the window it is still left out (and said), and on a calibrated host, whose model times neither the
    window nor the K/V exchange, too."""
    from dataclasses import replace

    from plait.plan import Cluster, Model, Training, explain, search
    from plait.plan.search import CP_MIN_SEQ_LEN
    from profile_util import synthetic_profile

    host_model = Model.from_llama_config(model_config(max_seq_len=256, sliding_window=32).to_dict(), 256)
    on_host = search(host_model, Cluster.from_profile(synthetic_profile(), 4), Training(8), top=3)
    assert not on_host.cp_searched and all(e.layout.cp == 1 for e in on_host.best), on_host.best

    full = Model.preset("llama3-8b", 16384)
    assert full.seq_len < CP_MIN_SEQ_LEN
    training = Training(2, masters="plait", elementwise="plait-eager")
    for model, splits in ((replace(full, sliding_window=4096), True), (full, False)):
        result = search(model, Cluster("h100-sxm", 4), training, top=1)
        said = [line for line in explain(result) if "context parallelism was not searched" in line]
        assert (result.best[0].layout.cp > 1) == splits and bool(said) != splits, (result.best[0].layout.short(), said)


def test_a_ring_rank_computes_exactly_the_blocks_its_queries_see():
    """``layout.sees`` (which K/V blocks a rank's ring attention computes) against the mask of every position: a
    block is skipped only when no query of the rank sees any of its keys, and a window shorter than a chunk leaves
    each rank its own block and its neighbours' (cp 4: one block of four skipped per rank, two at the ends)."""
    from plait.context_parallel.layout import causal_mask, local_positions, sees

    for cp in (2, 3, 4):
        for local in (2, 4, 8):
            for window in (None, 1, 2, 3, 5, 9, 100):
                for q_rank in range(cp):
                    for k_rank in range(cp):
                        mask = causal_mask(local_positions(local, cp, q_rank), local_positions(local, cp, k_rank),
                                           window)
                        assert sees(q_rank, k_rank, local, cp, window) == bool(mask.any()), (cp, local, window,
                                                                                             q_rank, k_rank)
    assert [sum(sees(r, k, 8, 4, 3) for k in range(4)) for r in range(4)] == [2, 3, 3, 2]
