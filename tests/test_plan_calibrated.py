"""The calibrated host's model terms: decoder-layer timings, plait's optimizer step, format-1 profiles."""

import pytest

from calibrated_util import (
    ATTENTION,
    MATMUL,
    MIX,
    OVERHEAD,
    host_blocks,
    host_cluster,
    host_section,
    with_layers,
)
from plait.errors import ConfigError
from plait.plan import Cluster, Layout, Model, step_end
from plait.plan.host import census, shapes
from plait.plan.host import compute as host_compute
from plait.plan.host import costs as host_costs
from plait.plan.host.figures import Rate
from plait.plan.host.profile import FORMAT, HostProfile, Section
from profile_util import synthetic_profile


def test_a_layer_s_elementwise_part_runs_at_the_calibration_blocks_speed():
    """Each block's bytes (as the census counts them) over its seconds beyond GEMMs and attention is the speed;
    a layer between the blocks' bytes per kernel is interpolated, its GEMMs and attention are unchanged."""
    works = [census.layer_work(shapes.block_local(s), 4) for s in shapes.CALIBRATION_BLOCKS]
    speed = 2e9  # bytes/s: both blocks' rest chosen to give it
    rest = tuple(w.elem_bytes / speed for w in works)
    sec = host_section(rest)
    block = host_compute.block_elementwise(sec)
    assert block is not None
    assert block.sizes == pytest.approx([w.elem_bytes / w.ops for w in works])
    assert block.alone == pytest.approx([speed, speed]) and block.shared == pytest.approx([speed / 2, speed / 2])
    model = Model.preset("small", seq_len=128)
    layout = Layout(microbatch_size=4)
    with_block, _, _ = host_blocks(model, host_cluster(sec), layout, "fp32")
    mix, _, _ = host_blocks(model, host_cluster(host_section(None)), layout, "fp32")
    w = census.layer_work(census.local(model, layout), 4)
    gemm = sum(f for f, _ in w.gemms) / MATMUL
    att = w.attention / ATTENTION
    table = w.nograd_ops * OVERHEAD * 0.4  # forward-only kernels, in both (none in a layer: RoPE's tables are shared)
    assert with_block.f_compute + with_block.b_compute == pytest.approx(3 * gemm + att + w.elem_bytes / speed + table)
    assert mix.f_compute + mix.b_compute == pytest.approx(3 * gemm + att + w.elem_bytes / MIX + w.ops * OVERHEAD
                                                          + table)
    assert with_block.w_compute == mix.w_compute == pytest.approx(gemm)


def test_real_layers_set_the_level_of_their_kernels():
    """Where a profile timed whole decoder layers, a layer of a calibration block's shape costs what that
    layer measured (alone, and with every process at once), whatever its kernels' figures say, split between
    forward and backward as it was; between the blocks the factor is interpolated in the log of the kernel
    figures' seconds, flat beyond; a profile without whole layers costs the kernels as they are."""
    from plait.plan.model import llama_ffn

    sec = host_section(tuple(2e-3 * (i + 1) for i in range(len(shapes.CALIBRATION_BLOCKS))))
    assert host_compute.in_step(sec, False, 1e-2) == host_compute.in_step(sec, True, 1e-2) == 1.0
    timed = with_layers(sec, (1.3, 1.1), (0.9, 1.05))
    alone = [host_compute.work_costs(census.layer_work(shapes.block_local(b), 4), sec, False, layer=True)
             for b in shapes.CALIBRATION_BLOCKS]
    small, large = (c.f_compute + c.b_compute for c in alone)
    assert host_compute.in_step(timed, False, small) == pytest.approx(1.3)
    assert host_compute.in_step(timed, False, large) == pytest.approx(1.1)
    assert host_compute.in_step(timed, True, small) == pytest.approx(0.9)
    assert host_compute.in_step(timed, True, small / 10) == pytest.approx(0.9)  # flat beyond
    assert host_compute.in_step(timed, True, large * 10) == pytest.approx(1.05)
    mid = (small * large) ** 0.5  # halfway in log
    assert host_compute.in_step(timed, False, mid) == pytest.approx(1.2)
    b, s, h, heads, kv = shapes.CALIBRATION_BLOCKS[-1]
    model = Model(n_layers=2, hidden=h, n_heads=heads, n_kv_heads=kv, ffn_hidden=llama_ffn(h), glu=True,
                  vocab=256, seq_len=s)
    layer, _, _ = host_blocks(model, host_cluster(timed), Layout(microbatch_size=b), "fp32")
    assert layer.f_compute + layer.b_compute == pytest.approx(timed.rates["layer"].alone[-1])
    plain, _, _ = host_blocks(model, host_cluster(sec), Layout(microbatch_size=b), "fp32")
    assert layer.w_compute == pytest.approx(1.1 * plain.w_compute)
    # and it splits between forward and backward as that layer did (0.36 in its forward)
    assert layer.f_compute / (layer.f_compute + layer.b_compute) == pytest.approx(0.36)
    assert plain.f_compute / (plain.f_compute + plain.b_compute) != pytest.approx(0.36, abs=0.01)


def test_selective_recomputation_costs_what_the_calibration_layers_recomputing_took():
    """Where a profile timed what recomputing its calibration layers' attention cores added
    (``recomputed_core``), a selective layer's recomputation costs the line through the blocks' figures at
    its query elements (alone, or shared with every process at it), not the core's forward that an older
    profile costs it at; never below 0; a tensor-parallel layer at its own rank's heads."""
    from dataclasses import replace

    from plait.plan.host.figures import SELECTIVE

    base = with_layers(host_section(tuple(2e-3 * (i + 1) for i in range(len(shapes.CALIBRATION_BLOCKS)))),
                        (1.2, 1.3), (1.4, 1.5))
    layer = base.rates["layer"]
    attn = base.rates["attention"]
    xs = [shapes.block_local(b).q for b in shapes.CALIBRATION_BLOCKS]
    alone, shared = (1e-4, 6e-4), (3e-4, 1e-3)  # seconds the recomputation added at each block
    sec = replace(base, rates={**base.rates, SELECTIVE: Rate(layer.sizes, alone, shared, 0.36)})
    model = Model.preset("tiny", seq_len=128)
    for tp in (1, 2):
        layout = Layout(tp=tp, pp=1, dp=1, microbatch_size=2, recompute="selective")
        sh = census.local(model, layout)

        def line(extra: tuple[float, float]) -> float:
            return max(0.0, extra[0] + (extra[1] - extra[0]) * (sh.q - xs[0]) / (xs[1] - xs[0]))  # noqa: B023

        for is_shared, extra in ((False, alone), (True, shared)):
            assert host_compute.selective_recompute(sec, is_shared, sh) == pytest.approx(line(extra))
            if tp == 1:  # (this section timed no collectives for a TP layer's)
                layer_cost, _, _ = host_blocks(model, host_cluster(sec), layout, "fp32", shared=is_shared)
                assert layer_cost.recompute == pytest.approx(line(extra))
    assert sh.q == census.local(model, Layout(tp=1, pp=1, dp=1, microbatch_size=2)).q / 2  # tp 2: half the heads
    layout = Layout(tp=1, pp=1, dp=1, microbatch_size=2, recompute="selective")
    w = census.layer_work(census.local(model, layout), 4)
    old_cost, _, _ = host_blocks(model, host_cluster(base), layout, "fp32")
    assert host_compute.selective_recompute(base, False, census.local(model, layout)) is None
    assert old_cost.recompute == pytest.approx(w.attention / attn.at(w.attention_size, False) * attn.forward_share)
    falling = replace(sec, rates={**sec.rates, SELECTIVE: Rate(layer.sizes, (1e-3, 0.0), shared, 0.36)})
    far = census.local(Model.preset("tiny", seq_len=1024), Layout(tp=1, pp=1, dp=1, microbatch_size=8))
    assert far.q > xs[1] and host_compute.selective_recompute(falling, False, far) == 0.0


def test_a_tensor_parallel_layer_costs_what_its_compute_twin_measured():
    """A layer sharded over TP ranks, shared, costs what the TP calibration's compute twin of its shape took
    (the twins set the level of a sharded layer), so that with the waits (the TP layer less its twin) it adds
    up to the TP layer timed; alone it keeps the whole layers' ratio of alone to shared; the twins of
    another group size do not move it."""
    from dataclasses import replace

    from plait.plan.host.figures import COLLECTIVES, Curve, TPBlock
    from plait.plan.model import llama_ffn

    base = with_layers(host_section(tuple(2e-3 * (i + 1) for i in range(len(shapes.CALIBRATION_BLOCKS)))),
                        (1.3, 1.1), (0.9, 1.05))
    tp_shapes = shapes.TP_CALIBRATION_BLOCKS
    twins = []
    for i, shape in enumerate(tp_shapes):  # twins measured at 0.8 and 0.7 times the kernel figures, shared
        c = host_compute.work_costs(census.layer_work(shapes.block_local(shape, 2, False), 4), base, True, layer=True)
        for sp in (False, True):
            twins.append(TPBlock(shape, 2, sp, 1.0, (0.8 - 0.1 * i) * (c.f_compute + c.b_compute)))
    curves = {(op, g): Curve((1024.0, 4e6), (5e-5, 5e-5 + 4e6 / 2e9)) for op in COLLECTIVES for g in (2, 4)}
    sec = replace(base, processes=2, threads=1, collectives=curves,
                  tp_blocks=(*twins, TPBlock(tp_shapes[0], 4, False, 1.0, 1e-9)))
    b, s, h, heads, kv = tp_shapes[-1]
    model = Model(n_layers=2, hidden=h, n_heads=heads, n_kv_heads=kv, ffn_hidden=llama_ffn(h), glu=True,
                  vocab=256, seq_len=s)
    cluster = Cluster.from_profile(HostProfile({"hostname": "h", "cores": 2}, {2: sec}), 2)
    layout = Layout(tp=2, microbatch_size=b)
    shared, _, _ = host_blocks(model, cluster, layout, "fp32", shared=True)
    alone, _, _ = host_blocks(model, cluster, layout, "fp32")
    assert shared.f_compute + shared.b_compute == pytest.approx(twins[-1].twin_s)
    work = census.layer_work(census.local(model, layout), 4)
    kernels = {x: host_compute.work_costs(work, sec, x, layer=True) for x in (False, True)}
    seconds = kernels[False].f_compute + kernels[False].b_compute
    ratio = host_compute.in_step(sec, False, seconds) / host_compute.in_step(sec, True, seconds)
    assert (alone.f_compute + alone.b_compute) / (shared.f_compute + shared.b_compute) == pytest.approx(
        ratio * seconds / (kernels[True].f_compute + kernels[True].b_compute))
    four = host_compute.work_costs(census.layer_work(shapes.block_local(tp_shapes[0], 4, False), 4), sec, True,
                                   layer=True)
    assert host_compute.in_tp_step(sec, 4, seconds) == pytest.approx(1e-9 / (four.f_compute + four.b_compute))
    assert host_compute.in_tp_step(sec, 8, seconds) is None


def test_shared_speed_is_alone_over_the_kinds_median_slowdown():
    """One size's shared figure is a noisy window: every size's shared speed is its speed alone over the
    median of the sizes' ratios, not the figure itself (here 2.5 at the middle size, read as 5)."""
    r = Rate((1.0, 10.0, 100.0), (10.0, 20.0, 40.0), (5.0, 5.0, 20.0))  # ratios 2, 4, 2
    assert r.slowdown == pytest.approx(2.0)
    assert [r.at(x, True) for x in (1.0, 10.0, 100.0)] == pytest.approx([5.0, 10.0, 20.0])
    assert r.at(10.0, False) == pytest.approx(20.0)
    assert r.at(1000.0, True) == pytest.approx(20.0)  # flat beyond the sizes, as alone


def test_a_blocks_shared_rest_slows_as_the_elementwise_kernels():
    """The rest's own shared figure (here only 1.2 times alone: the difference of two noisy ones) is not
    used; shared, a block's rest takes its time alone times the element-wise kernels' slow-down (2 here)."""
    works = [census.layer_work(shapes.block_local(s), 4) for s in shapes.CALIBRATION_BLOCKS]
    speed = 2e9
    rest = tuple(w.elem_bytes / speed for w in works)
    sec = host_section(rest)
    sec = Section(1, 2, {**sec.rates, "block": Rate(sec.rates["block"].sizes, rest,
                                                      tuple(1.2 * r for r in rest), 0.3)}, OVERHEAD, 1e10)
    block = host_compute.block_elementwise(sec)
    assert block is not None
    assert block.shared == pytest.approx([speed / 2, speed / 2])


def test_block_rest_is_floored_and_other_blocks_ignored():
    """A rest measured as 0 (noise) costs a tenth of the kernel mix's estimate, not nothing; a profile whose
    blocks are not plan.host.shapes' current ones is not used (the mix is)."""
    sec = host_section((0.0, 0.0))
    block = host_compute.block_elementwise(sec)
    w = census.layer_work(shapes.block_local(shapes.CALIBRATION_BLOCKS[0]), 4)
    floor = host_compute.BLOCK_REST_FLOOR * (w.elem_bytes / MIX + w.ops * OVERHEAD)
    assert block is not None and block.alone[0] == pytest.approx(w.elem_bytes / floor)
    other = Section(1, 2, {**sec.rates, "block": Rate((10.0, 20.0), (1.0, 1.0), (1.0, 1.0))}, OVERHEAD, 1e10)
    assert host_compute.block_elementwise(other) is None


def test_optimizer_step_is_the_timed_seconds_per_parameter_and_tensor():
    """Seconds per parameter and per parameter tensor as calibrated (an older profile: per parameter alone),
    divided among ZeRO's shards; format 1: the counted bytes at the streaming bandwidth plus kernels per
    tensor."""
    params = 1e6
    tensors = 8 * step_end.PARAM_TENSORS_PER_LAYER + 3
    timed = host_cluster(host_section(None, optimizer=3e-9))
    assert step_end.optimizer_time(timed, Layout(), params, 8) == pytest.approx(3e-3)
    with pytest.raises(ConfigError, match="optimizer: 'torch-foreach-adamw' is costed on catalogue GPUs"):
        step_end.optimizer_time(timed, Layout(), params, 8, "torch-foreach-adamw")  # the host times plait's own
    per_tensor = host_cluster(host_section(None, optimizer=3e-9, per_tensor=3e-5))
    assert step_end.optimizer_time(per_tensor, Layout(), params, 8) == pytest.approx(3e-3 + tensors * 3e-5)
    assert step_end.optimizer_time(per_tensor, Layout(dp=2, zero=1), params, 8) == pytest.approx(
        (3e-3 + tensors * 3e-5) / 2)
    sec2 = host_section(None, optimizer=3e-9)
    two = Cluster.from_profile(HostProfile({"hostname": "h", "cores": 2}, {2: Section(2, 1, sec2.rates, OVERHEAD,
                                                                                        1e10, {}, 3e-9)}), 2)
    assert step_end.optimizer_time(two, Layout(dp=2, zero=1), params, 8) == pytest.approx(1.5e-3)
    counted = step_end.optimizer_time(host_cluster(host_section(None)), Layout(), params, 8)
    assert counted == pytest.approx(host_costs.EAGER_OPTIMIZER_TRAFFIC * params / 1e10
                                    + host_costs.EAGER_OPTIMIZER_OPS * tensors * OVERHEAD * 0.4)


def test_zero_publish_copies_the_gathered_weights_into_every_parameter(monkeypatch):
    """ZeRO's publish beyond its all-gather: the shard zeroed and filled from the masters, the gathered buffer
    copied into every parameter (in the weights' dtype: fp32 or bf16, on a host or GPUs alike), a copy kernel
    per owned piece and per tensor; nothing without ZeRO. The estimate counts it in the optimizer part and
    phase."""
    from plait.plan import memory as mem
    from plait.plan.config import Training
    from plait.plan.estimate import estimate
    from plait.plan.stages import layout_stages

    params, layers = 1e6, 8
    tensors = 8 * step_end.PARAM_TENSORS_PER_LAYER + 3
    host = host_cluster(host_section(None))
    kernels = (tensors / 2 + tensors) * OVERHEAD * 0.4
    assert step_end.publish_time(host, Layout(dp=2), params, layers, "fp32") == 0.0
    assert step_end.publish_time(host, Layout(dp=2, zero=1), params, layers, "fp32") == pytest.approx(
        (12 * params / 2 + 8 * params) / 1e10 + kernels)
    assert step_end.publish_time(host, Layout(dp=2, zero=1), params, layers, "bf16") == pytest.approx(
        (8 * params / 2 + 4 * params) / 1e10 + kernels)
    gpus = Cluster("h100-sxm", 8)
    assert step_end.publish_time(gpus, Layout(dp=8, zero=2), params, layers, "bf16") == pytest.approx(
        (8 * params / 8 + 4 * params) / gpus.gpu.memory_bandwidth)
    assert step_end.publish_time(gpus, Layout(dp=8, zero=2), params, layers, "fp32") == pytest.approx(
        (12 * params / 8 + 8 * params) / gpus.gpu.memory_bandwidth)

    model = Model.preset("small", seq_len=128)
    four = Cluster.from_profile(synthetic_profile(counts=(4,)), 4)
    layout = Layout(pp=2, dp=2, zero=1, microbatch_size=1)
    counted = step_end.publish_time(four, layout, mem.max_rank_params(model, layout),
                                    max(layout_stages(model, layout).rank_layers), "fp32")
    assert counted > 0
    before = estimate(model, four, layout, Training(8, precision="fp32"))
    monkeypatch.setattr(step_end, "publish_time", lambda *a, **k: counted + 0.125)
    after = estimate(model, four, layout, Training(8, precision="fp32"))
    assert after.time["optimizer"] - before.time["optimizer"] == pytest.approx(0.125)
    assert after.phases["optimizer"] - before.phases["optimizer"] == pytest.approx(0.125)
    assert after.step_time_s - before.step_time_s == pytest.approx(0.125)


def test_calibration_times_the_optimizer_beyond_the_cache_and_per_tensor(monkeypatch):
    """``plait calibrate`` times the optimizer step over parameters whose state outgrows the cache and over
    many small tensors, and solves the two times for the cost per parameter and per tensor."""
    import torch

    from plait.calibrate import kernels

    seen = []

    def step_time(params, device):  # a step of a known cost per parameter and per tensor
        p, n = sum(x.numel() for x in params), len(params)
        seen.append((p, n))
        return 2e-9 * p + 3e-5 * n, p, n

    monkeypatch.setattr(kernels, "_optimizer_step_time", step_time)
    assert kernels.optimizer_times(torch.device("cpu")) == pytest.approx((2e-9, 3e-5))
    (big, _), (_, tensors) = seen
    assert 16 * big >= kernels.OPTIMIZER_STATE_BYTES and tensors == kernels.OPTIMIZER_SMALL_TENSORS[0]


def test_format_1_profiles_still_read(tmp_path):
    """A profile written before decoder layers and the optimizer were timed loads (no block, no optimizer
    figure) and predicts with the kernel mix; the current format round-trips both."""
    new = synthetic_profile(counts=(1, 2, 4), block=True)
    assert HostProfile.from_toml(new.to_toml()) == new and new.section(4).pipeline_s == 0.25
    assert new.section(2).optimizer_s_per_param == 4e-9 and "block" in new.section(2).rates
    assert new.section(2).optimizer_s_per_tensor == 3e-5
    old = synthetic_profile(counts=(1, 2))
    text = old.to_toml().replace(f"format = {FORMAT}", "format = 1")
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith("optimizer_s_"))
    back = HostProfile.from_toml(text)
    assert back == old and back.section(1).optimizer_s_per_param == back.section(1).optimizer_s_per_tensor == 0.0
    assert host_compute.block_elementwise(back.section(1)) is None
    with pytest.raises(ValueError, match="format 1, 2, 3, 4 or 5"):
        HostProfile.from_toml(text.replace("format = 1", f"format = {FORMAT + 1}"))


def test_format_2_decoder_layers_split_as_the_kernel_mix():
    """Format 2 stored the whole layer's forward share without autograd, not its rest's: read, the layer's
    element-wise part splits as the kernel mix's (what costed it then); format 3 keeps the measured share."""
    new = synthetic_profile(counts=(1,), block=True)
    assert HostProfile.from_toml(new.to_toml()).section(1).rates["block"].forward_share == 0.3
    old = HostProfile.from_toml(new.to_toml().replace(f"format = {FORMAT}", "format = 2")).section(1)
    assert old.rates["block"].forward_share == old.rates["elementwise"].forward_share == 0.35
    assert old.rates["block"].alone == new.section(1).rates["block"].alone


def test_a_layer_s_elementwise_part_splits_as_the_calibration_blocks_rest():
    """The layer's element-wise seconds go to the forward by the blocks' measured share (the real layer's
    rest, autograd recording), not the kernel mix's; GEMMs, attention and the total do not move."""
    from dataclasses import replace

    works = [census.layer_work(shapes.block_local(s), 4) for s in shapes.CALIBRATION_BLOCKS]
    speed = 2e9
    sec = host_section(tuple(w.elem_bytes / speed for w in works))
    model = Model.preset("small", seq_len=128)
    layout = Layout(microbatch_size=4)
    w = census.layer_work(census.local(model, layout), 4)
    gemm, att, el = sum(f for f, _ in w.gemms) / MATMUL, w.attention / ATTENTION, w.elem_bytes / speed
    table = w.nograd_ops * OVERHEAD * 0.4
    costs = {}
    for share in (0.3, 0.8):
        blocks = replace(sec.rates["block"], forward_share=share)
        layer, _, _ = host_blocks(model, host_cluster(replace(sec, rates={**sec.rates, "block": blocks})),
                                         layout, "fp32")
        assert layer.f_compute == pytest.approx(gemm + 0.25 * att + share * el + table)
        assert layer.b_compute == pytest.approx(2 * gemm + 0.75 * att + (1 - share) * el)
        costs[share] = layer
    assert costs[0.8].f_compute + costs[0.8].b_compute == pytest.approx(costs[0.3].f_compute + costs[0.3].b_compute)


def test_calibration_takes_the_largest_blocks_forward_share():
    """The decoder layers' forward share is the largest calibration block's (the smaller's rest is mostly
    kernels' fixed costs); the other kinds take the plain mean of their sizes'. The whole layers' seconds,
    alone and shared as measured, are the ``layer`` kind, with the larger layer's forward share."""
    from plait.calibrate.run import _rates

    def figures(block):
        return {"matmul": [(1e6, 1e10, 1 / 3), (1e9, 2e10, 1 / 3)], "attention": [(1e3, 1e9, 0.2), (1e4, 2e9, 0.4)],
                "elementwise": [(1e3, 1e9, 0.25), (1e5, 2e9, 0.35)], "block": block}

    rates = _rates(figures([(98304.0, 3e-3, 0.4, 2e-2, 0.35, 3e-3), (4096.0, 1e-3, 0.8, 2e-3, 0.5, 5e-4)]),
                   figures([(98304.0, 6e-3, 0.1, 4e-2, 0.3, 9e-3), (4096.0, 2e-3, 0.9, 4e-3, 0.6, 1e-4)]))
    assert rates["block"].forward_share == pytest.approx(0.4)
    assert rates["attention"].forward_share == pytest.approx(0.3)
    assert rates["block"].alone == (1e-3, 3e-3) and rates["block"].shared == (2e-3, 6e-3)
    assert rates["layer"] == Rate((4096.0, 98304.0), (2e-3, 2e-2), (4e-3, 4e-2), 0.35)
    # the recomputation alone as measured; shared as the whole layer shared the cores (not as its pairs read)
    assert rates["recomputed_core"] == Rate((4096.0, 98304.0), (5e-4, 3e-3), (1e-3, 6e-3), 0.35)


def test_zero_1_and_2_twins_are_ranked_once():
    """plait's ZeRO-2 reduces once per step like ZeRO-1: the same layout at both stages takes the same time, so
    only the one with less memory (else ZeRO-1) is ranked, and the result says how many were left out."""
    from dataclasses import replace

    from plait.plan import Training, search

    cluster = Cluster.from_profile(synthetic_profile(counts=(4,)), 4)
    result = search(Model.preset("tiny", seq_len=128), cluster, Training(16, precision="fp32"), top=6)
    shapes = [replace(e.layout, zero=0) for e in result.best if e.layout.zero < 3]  # ZeRO-3 steps differently
    assert result.twins > 0 and len(shapes) == len(set(shapes))
    assert any(e.layout.zero == 1 for e in result.best)


@pytest.mark.parametrize("cp", [2, 4])
def test_a_context_parallel_rank_attends_its_queries_to_the_whole_rows_keys(cp):
    """Under context parallelism a rank's S/cp queries attend to the row's S keys (the causal load balance gives
    each rank 1/cp of the row's pairs): its attention is 1/cp of one rank's at cp = 1, its GEMMs too. Counted
    against its own S/cp keys alone it was (1/cp)², and a cp2 step's attention predicted at a quarter of cp1's."""
    model = Model.preset("tiny", seq_len=512)
    whole = census.layer_work(census.local(model, Layout(microbatch_size=2)), 4)
    split = census.layer_work(census.local(model, Layout(microbatch_size=2, cp=cp)), 4)
    assert split.attention == pytest.approx(whole.attention / cp)
    assert sum(f for f, _ in split.gemms) == pytest.approx(sum(f for f, _ in whole.gemms) / cp)
