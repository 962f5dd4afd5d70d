"""The calibrated host's step: TP collectives' waits, the DP reduction, phases at the mean speed, shared cores."""

import pytest

from calibrated_util import (
    MATMUL,
    OVERHEAD,
    host_blocks,
    host_cluster,
    host_section,
    tp_cluster,
    with_layers,
)
from plait.plan import Cluster, Layout, Model, step_end
from plait.plan.costs import StageCosts
from plait.plan.host import shapes
from plait.plan.host.profile import HostProfile, Section
from profile_util import synthetic_profile


def test_every_tp_collective_waits_what_the_timed_tp_layer_showed():
    """A TP layer whose collectives took 6 ms each beyond their back-to-back time (plait.calibrate.tp_block:
    the layer less its compute twin, less the curves' collectives) adds 6 ms to every TP collective of a
    run: forward and backward of a layer (4 + 6 under SP: the backward gathers each region's input again; 2 + 2
    without), the head's and the embedding's;
    the kernels are unchanged. A negative wait (a curve above what the layer showed) lowers the collectives
    to what the layer showed, never below 0; a group size not timed waits 0, and an older quick calibration's one
    form stands in for the other."""
    extra = 6e-3
    probe = tp_cluster({})
    cluster = tp_cluster({(2, False): extra, (4, False): extra, (4, True): extra})
    for n in (1e3, 5e5, 1e7):  # the same wait at both sizes timed: the same at every size
        assert cluster.costs.tp_wait(4, True, n) == pytest.approx(extra)
        assert cluster.costs.tp_wait(2, True, n) == pytest.approx(extra)  # the non-SP form stands in
    assert tp_cluster({(2, False): -1e-3}).costs.tp_wait(2, False, 5e5) == pytest.approx(-1e-3)
    assert tp_cluster({(2, False): extra}).costs.tp_wait(4, False, 5e5) == 0.0
    assert probe.costs.tp_wait(2, False, 5e5) == 0.0
    model = Model.preset("small", seq_len=128)
    for sp, (nf, nb) in ((False, (2, 2)), (True, (4, 6))):
        layout = Layout(tp=4, microbatch_size=4, sequence_parallel=sp)
        (layer, embed, head), (l0, e0, h0) = (host_blocks(model, c, layout, "fp32")
                                              for c in (cluster, probe))
        assert (layer.f_tp - l0.f_tp, layer.b_tp - l0.b_tp) == pytest.approx((nf * extra, nb * extra))
        assert (head.f_tp - h0.f_tp, head.b_tp - h0.b_tp) == pytest.approx(((3 if sp else 2) * extra, extra))
        assert (embed.f_tp - e0.f_tp, embed.b_tp - e0.b_tp) == pytest.approx((extra, 0.0))
        assert layer.f_compute == l0.f_compute and layer.b_compute == l0.b_compute


def test_tp_wait_is_a_line_in_the_activation_bytes_through_the_sizes_timed():
    """The TP layer timed at two sizes (plan.shapes.TP_CALIBRATION_BLOCKS: 192 KB and 768 KB activations)
    waited 1 ms and 6 ms per collective: the wait at another size is the line through the two;
    a run's layer adds it at its own activation's bytes, and a block's collectives cost at least 0. A profile
    with one size timed (an older calibration) waits that size's figure at every size."""
    small, large = (shapes.block_local(s).n * 4 for s in shapes.TP_CALIBRATION_BLOCKS)
    assert (small, large) == (2 * 64 * 384 * 4, 4 * 128 * 384 * 4)
    cluster = tp_cluster({(2, False): (1e-3, 6e-3)})

    def line(n: float) -> float:
        return 1e-3 + 5e-3 * (n - small) / (large - small)

    for n in (small, large, (small + large) / 2, 2 * large, small / 4):
        assert cluster.costs.tp_wait(2, False, n) == pytest.approx(line(n), abs=1e-12), n
    assert cluster.costs.tp_wait(2, False, small / 4) < 0  # below the line's zero (77 KB)
    assert cluster.costs.tp_wait(2, False, 2 * large) > 6e-3
    model = Model.preset("small", seq_len=128)  # 4x128 tokens of width 256 in fp32: 512 KB
    layout = Layout(tp=2, microbatch_size=4)
    probe = tp_cluster({(2, False): 0.0})
    (layer, _, _), (l0, _, _) = (host_blocks(model, c, layout, "fp32") for c in (cluster, probe))
    assert layer.f_tp - l0.f_tp == pytest.approx(2 * line(4 * 128 * 256 * 4))
    low = tp_cluster({(2, False): -2e-4})  # the curves 0.2 ms above what the layer showed, per collective
    (layer, _, head), (l0, _, h0) = (host_blocks(model, c, layout, "fp32") for c in (low, probe))
    assert l0.f_tp > 4e-4 and h0.b_tp > 2e-4
    assert layer.f_tp - l0.f_tp == pytest.approx(-4e-4) and head.b_tp - h0.b_tp == pytest.approx(-2e-4)
    (layer, embed, head) = host_blocks(model, tp_cluster({(2, False): -1.0}), layout, "fp32")
    assert layer.f_tp == layer.b_tp == head.f_tp == embed.f_tp == 0.0  # never below nothing
    old = tp_cluster({(2, False): 3e-3}, shapes=shapes.TP_CALIBRATION_BLOCKS[:1])
    assert old.costs.tp_wait(2, False, small) == old.costs.tp_wait(2, False, 10 * large) == pytest.approx(3e-3)


def test_calibrate_summary_shows_each_section_and_its_tp_wait(tmp_path):
    """What `plait calibrate` prints after measuring: a row per process count, with the wait of the largest TP
    group timed (as HostCosts.tp_wait computes it from the profile)."""
    from pathlib import Path

    from rich.console import Console

    from plait.cli.calibrate import _summary

    profile = synthetic_profile(counts=(1, 2, 4), block=True)
    console = Console(width=200, record=True)
    _summary(console, profile, Path(tmp_path / "host.toml"))
    text = console.export_text()
    want = Cluster.from_profile(profile, 4).costs.tp_wait(4, False, 1 << 20)
    assert want > 0 and f"{want * 1e3:.2f} (tp4)" in text
    assert "TP wait" in text and "1 MB ms" in text and text.count("(tp") == 2  # sections of 2 and 4 processes; 1 none
    assert "host speed during calibration" not in text  # an older profile: no speed probes
    for moved, warned in ((0.4, False), (0.8, True)):
        probed = HostProfile({**profile.host, "speed_flops": 9e10, "speed_moved": moved}, profile.sections)
        console = Console(width=200, record=True)
        _summary(console, probed, Path(tmp_path / "host.toml"))
        text = console.export_text()
        assert "90.0 GFLOP/s on average" in text and f"moved {moved:.0%}" in text
        assert ("warning: the host's speed moved more than 60%" in text) == warned


def test_dp_reduction_adds_to_the_step_on_a_calibrated_host():
    """A calibrated host's processes fill its cores, so the gradient reduction (all-reduce; ZeRO's
    reduce-scatter and all-gather) adds its curves' time to the step; a catalogue GPU's backward hides it."""
    from plait.plan import Training, estimate
    from plait.plan import memory as mem

    model = Model.preset("tiny", seq_len=128)
    host = Cluster.from_profile(synthetic_profile(counts=(4,)), 4)
    for zero in (0, 1):
        layout = Layout(pp=2, dp=2, microbatch_size=1, zero=zero, schedule="1f1b")
        est = estimate(model, host, layout, Training(8, precision="fp32"))
        sync = step_end.dp_sync_time(model, host, layout, mem.max_rank_params(model, layout))
        assert sync > 0 and est.time["dp_comm"] == pytest.approx(sync)
    gpus = Cluster("a100-40gb", 4)
    assert gpus.costs.hidden_reduction(0.25) == 0.25 and host.costs.hidden_reduction(0.25) == 0.0
    layout = Layout(pp=2, dp=2, microbatch_size=1, schedule="1f1b")
    sync = step_end.dp_sync_time(model, gpus, layout, mem.max_rank_params(model, layout))
    assert 0.0 <= estimate(model, gpus, layout, Training(64)).time["dp_comm"] < sync  # the backward hides some


def test_each_phase_of_a_calibration_is_brought_to_the_hosts_mean_speed():
    """The host's speed during a section's three phases (kernels alone and shared, timed in pairs; collective
    curves; TP layers): each phase's figures scale by the mean of all the probes over its own speed (rates up, seconds
    down where the phase ran slow), and the profile says how far the speed moved."""
    from plait.calibrate.run import at_mean_speed
    from plait.plan.host.figures import Curve, TPBlock

    base = host_section((1e-3, 4e-3), optimizer=2e-9, per_tensor=2e-5)
    four = Section(4, 1, base.rates, OVERHEAD, 1e10, {("all_reduce", 2): Curve((1e3, 1e6), (1e-4, 1e-3))}, 2e-9,
                   (TPBlock(shapes.TP_CALIBRATION_BLOCKS[0], 2, False, 0.05, 0.03),), 2e-5)
    # probes 50, 50, 100, 200, 100 and six at 100: mean 100; kernels at 50 (half speed), curves at 150, TP
    # layers at 150
    probes = [50.0, 50.0, 100.0, 200.0, 100.0] + [100.0] * 6
    sections, mean, moved = at_mean_speed({1: (base, [100.0] * 3), 4: (four, [50.0, 150.0, 150.0])}, probes)
    assert mean == pytest.approx(100.0) and moved == pytest.approx(1.5)
    one, s = sections[1], sections[4]
    assert one == base  # probed at the mean speed throughout: unchanged
    mm = s.rates["matmul"]
    assert mm.alone[0] == pytest.approx(2 * MATMUL) and mm.shared[0] == pytest.approx(MATMUL / 2 * 2)
    assert s.rates["block"].alone == pytest.approx((0.5e-3, 2e-3))  # seconds: halved where the phase ran at half
    assert s.op_overhead_s == pytest.approx(OVERHEAD / 2) and s.optimizer_s_per_param == pytest.approx(1e-9)
    assert s.optimizer_s_per_tensor == pytest.approx(1e-5)
    assert s.memory_bandwidth == pytest.approx(1e10 * 2)  # measured in the kernels' phase
    assert s.collectives[("all_reduce", 2)].seconds == pytest.approx((1e-4 * 1.5, 1e-3 * 1.5))
    assert s.tp_blocks[0].seconds == pytest.approx(0.05 * 1.5) and s.tp_blocks[0].twin_s == pytest.approx(0.045)
    slow_one, *_ = at_mean_speed({1: (base, [50.0] * 3), 2: (base, [150.0] * 3)}, [50.0, 150.0])[0].values()
    assert slow_one.rates["matmul"].shared[0] == pytest.approx(MATMUL / 2 * 2)


@pytest.mark.parametrize("layout", [Layout(pp=2, dp=2, microbatch_size=1, schedule="1f1b"),
                                    Layout(pp=2, dp=2, virtual_stages=2, microbatch_size=1, zero=1, schedule="zbv"),
                                    Layout(tp=2, pp=2, microbatch_size=2, schedule="1f1b"),
                                    Layout(tp=4, microbatch_size=2, sequence_parallel=True)])
def test_phases_split_the_step_where_the_runtime_spends_it(layout):
    """``Estimate.phases`` adds up to the step: the forward/backward part, then the exposed gradient
    reduction (ZeRO: the reduce-scatter), the sum over TP of the gradients each TP rank holds part of, and
    the loss's sum over the world (only with DP replicas: a pipeline alone sends it point to point, TP alone
    holds it), then the optimizer step with the gradient norm's sum and ZeRO's all-gather of the updated
    weights."""
    from plait.plan import Training, estimate
    from plait.plan import memory as mem

    model = Model.preset("tiny", seq_len=128)
    host = Cluster.from_profile(synthetic_profile(counts=(4,)), 4)
    est = estimate(model, host, layout, Training(8, precision="fp32"))
    t, ph = est.time, est.phases
    assert set(ph) == {"forward_backward", "grad_reduction", "optimizer"} and min(ph.values()) >= 0.0
    assert sum(ph.values()) == pytest.approx(est.step_time_s, rel=1e-12)
    one = host.costs.collective("all_reduce", 16, 4)  # a few bytes over the world
    assert one > 0
    reduction, gather = step_end.dp_sync_parts(model, host, layout, mem.max_rank_params(model, layout))
    loss = one if layout.dp > 1 else 0.0
    # tiny (hidden 128, 4 layers, 2 KV heads of 32) over tp 4 with SP: each layer's two norms and its K and V
    # projections (replicated: 4 ranks, 2 KV heads), and the final norm, summed over TP after the backward
    tp_sum = host.costs.collective("all_reduce", 4 * (4 * (2 * 128 + 2 * 128 * 64) + 128), 4) \
        if layout.sequence_parallel else 0.0
    assert t["sync"] == pytest.approx(tp_sum + loss + one)  # no stop-signal check: not in the step's time
    assert ph["forward_backward"] == pytest.approx(est.step_time_s - t["dp_comm"] - t["optimizer"] - t["sync"])
    assert ph["grad_reduction"] == pytest.approx(reduction + tp_sum + loss)
    assert ph["optimizer"] == pytest.approx(t["optimizer"] + gather + one)
    assert (gather > 0) == (layout.zero > 0) and (reduction > 0) == (layout.dp > 1)


def test_tp_partial_gradients_counted_as_the_runtime_marks_them():
    """The replicated parameters whose gradient is summed over TP after the backward: SP's norms (LayerNorm:
    weight and bias) and row-parallel biases, the final norm on the last stage, K and V where TP exceeds the
    KV heads, an MoE router; nothing without TP; under ZeRO each rank sums its shard."""
    gpt = Model(n_layers=2, hidden=64, n_heads=4, vocab=256, seq_len=32, bias=True, layernorm=True)
    assert step_end.tp_partial_elements(gpt, Layout(tp=2), 2, True) == 0.0  # no SP; KV heads 4 >= tp
    sp = Layout(tp=2, sequence_parallel=True)
    assert step_end.tp_partial_elements(gpt, sp, 2, False) == 2 * (2 * 2 * 64 + 2 * 64)
    assert step_end.tp_partial_elements(gpt, sp, 2, True) == 2 * (2 * 2 * 64 + 2 * 64) + 2 * 64
    gqa = Model(n_layers=3, hidden=64, n_heads=4, n_kv_heads=1, vocab=256, seq_len=32, n_experts=4, top_k=1)
    assert step_end.tp_partial_elements(gqa, Layout(tp=2), 3, True) == 3 * (2 * 64 * 16 + 64 * 4)
    assert step_end.tp_partial_elements(gqa, Layout(dp=2), 3, True) == 0.0
    host = host_cluster(host_section(None))
    nbytes = 4 * step_end.tp_partial_elements(gqa, Layout(tp=2), 3, True)
    two = Cluster.from_profile(synthetic_profile(counts=(4,)), 4)
    assert step_end.tp_partial_time(gqa, two, Layout(tp=2, dp=2, zero=1), 3, True) == pytest.approx(
        two.costs.collective("all_reduce", nbytes / 2, 2))
    assert step_end.tp_partial_time(gqa, host, Layout(), 3, True) == 0.0


def test_shared_cores_counts_processes_at_their_speed_alone():
    from plait.plan.host.sharing import shared_cores

    alone = [StageCosts(f_compute=1.0, b_compute=2.0), StageCosts(f_compute=1.0, b_compute=2.0)]
    shared = [StageCosts(f_compute=2.2, b_compute=4.4), StageCosts(f_compute=2.2, b_compute=4.4)]
    assert shared_cores(alone, shared, 4) == pytest.approx(4 / 2.2)  # each at 1/2.2 of its speed alone
    assert shared_cores(alone, alone, 2) == 2.0  # no slow-down: every process has a core
    faster = [StageCosts(f_compute=0.5, b_compute=1.0)] * 2
    assert shared_cores(alone, faster, 2) == 2.0  # never more cores than processes
    assert shared_cores(alone, faster, 4, most=2.0) == 2.0  # nor than the host's cores
    assert shared_cores(alone, shared, 4, most=2.0) == pytest.approx(4 / 2.2)  # below them: as measured


def test_host_cores_are_the_cores_over_a_processs_threads():

    prof = synthetic_profile(counts=(1, 4))  # two cores: one process of two threads, or four of one
    assert Cluster.from_profile(prof, 4).costs.cores == 2.0
    assert Cluster.from_profile(prof, 1).costs.cores == 1.0  # its two threads take both cores


def test_action_costs_split_the_backward_into_input_and_weight_halves():
    from plait.plan.host.sharing import action_costs

    chunks = [StageCosts(f_compute=1.0, b_compute=2.0, w_compute=0.75, f_tp=0.1, b_tp=0.2, recompute=0.5),
              StageCosts(f_compute=3.0, b_compute=5.0, w_compute=2.0)]
    cpu, comm = action_costs(chunks, split=True)
    assert cpu == {"F": [1.0, 3.0], "B": [2.5, 5.0], "I": [1.75, 3.0], "W": [0.75, 2.0]}
    assert comm == {"F": [0.1, 0.0], "B": [0.2, 0.0], "I": [0.2, 0.0], "W": [0.0, 0.0]}
    assert action_costs(chunks, split=False)[0]["I"] == [0.0, 0.0]  # a whole backward has no input half


def test_pipelines_on_a_crowded_host_run_as_slow_as_the_calibrations_pipeline():
    """Where the calibration timed a pipeline of real layers (processes outnumbering the cores) slower than the
    same work without hand-offs, the hand-off slow-down is what makes the simulator give that pipeline its
    measured time: none when it ran as fast as its work, more the slower it ran; a pipelined layout is
    predicted slower with it, a layout without a pipeline not at all."""
    from dataclasses import replace

    from plait.plan.config import Training
    from plait.plan.estimate import estimate
    from plait.plan.host.figures import COLLECTIVES, Curve
    from plait.plan.host.sharing import handoff

    base = with_layers(host_section(tuple(2e-3 * (i + 1) for i in range(len(shapes.CALIBRATION_BLOCKS)))),
                        (1.2, 1.1), (2.0, 2.1))
    curves = {(op, g): Curve((1024.0, 4e6), (5e-5, 5e-5 + 4e6 / 2e9)) for op in COLLECTIVES for g in (2, 4)}
    four = replace(base, processes=4, threads=1, collectives=curves)
    twin = shapes.PIPELINE_CALIBRATION_MICROBATCHES * four.rates["layer"].shared[-1]

    def cluster(ratio: float) -> Cluster:
        sec = replace(four, pipeline_s=ratio * twin, pipeline_twin_s=twin) if ratio else four
        return Cluster.from_profile(HostProfile({"hostname": "h", "cores": 2}, {4: sec}), 4)

    assert handoff(cluster(0.0).costs) == 1.0  # not timed
    assert handoff(cluster(0.9).costs) == 1.0  # as fast as its work (or faster): no slow-down
    slow, slower = handoff(cluster(1.1).costs), handoff(cluster(1.2).costs)
    assert 1.0 < slow < slower
    model = Model.preset("small", seq_len=128)
    training = Training(global_batch=16)
    piped, flat = Layout(pp=2, dp=2, microbatch_size=2), Layout(dp=4, microbatch_size=1)
    assert estimate(model, cluster(1.2), piped, training).step_time_s > \
        estimate(model, cluster(0.0), piped, training).step_time_s
    assert estimate(model, cluster(1.2), flat, training).step_time_s == \
        estimate(model, cluster(0.0), flat, training).step_time_s


def test_an_moe_layers_all_to_alls_are_the_measured_ones():
    """A calibrated host costs an MoE layer's exchanges over ep ranks at the measured all-to-all curve: forward
    the per-expert counts (E int64), the rows out and back (its tokens once per routed expert: a TP rank's 1/tp
    of them with whole experts, all with split ones); backward the two row exchanges again. At ep = 1 none."""
    from dataclasses import replace

    from plait.plan import experts

    moe = Model(n_layers=2, hidden=64, n_heads=4, vocab=256, seq_len=32, ffn_hidden=128, glu=True, n_experts=4,
                top_k=2)
    four = Cluster.from_profile(synthetic_profile(counts=(4,)), 4)
    sec = four.costs.section
    act = 2 * 32 * 64 * 4  # [2, 32, 64] fp32
    for lay in (Layout(tp=2, dp=2, microbatch_size=2), Layout(tp=2, dp=2, microbatch_size=2, expert_tp=True)):
        alone = four.costs.blocks(moe, lay, "fp32").layer
        for ep in (2, 4) if not lay.expert_tp else (2,):
            lay_ep = replace(lay, ep=ep)
            layer = four.costs.blocks(moe, lay_ep, "fp32").layer
            rows = 2 * sec.collective("all_to_all", ep, experts.dispatch(moe, lay_ep, act)[0])
            assert rows > 0 and experts.dispatch(moe, lay_ep, act)[0] == act * 2 / (1 if lay.expert_tp else 2)
            assert layer.f_tp == pytest.approx(alone.f_tp + rows + sec.collective("all_to_all", ep, 8 * 4))
            assert layer.b_tp == pytest.approx(alone.b_tp + rows)
            assert layer.f_compute == alone.f_compute


@pytest.mark.parametrize("flag", ["tp_comm_overlap", "sp_async_backward"])
def test_other_stacks_tp_overlaps_are_refused_on_a_calibrated_host(flag):
    """The overlaps other stacks run (userbuffers, the asynchronous SP backward) are modelled on catalogue GPUs
    only: a calibrated host runs plait's collectives, so an estimate there asking for one is an error, not a
    silently exposed cost."""
    from plait.errors import ConfigError
    from plait.plan import Training, estimate

    host = Cluster.from_profile(synthetic_profile(counts=(4,)), 4)
    layout = Layout(tp=2, dp=2, sequence_parallel=True)
    estimate(Model.preset("tiny", seq_len=128), host, layout, Training(8, precision="fp32"))
    with pytest.raises(ConfigError, match=f"{flag}: models another stack's overlap on catalogue GPUs"):
        estimate(Model.preset("tiny", seq_len=128), host, layout, Training(8, precision="fp32", **{flag: True}))
