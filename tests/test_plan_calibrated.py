"""The calibrated host's model terms: decoder-layer timings, plait's optimizer step, format-1 profiles."""

import pytest

from plait.errors import ConfigError
from plait.plan import Cluster, Layout, Model, step_end
from plait.plan.costs import StageCosts
from plait.plan.host import census, shapes
from plait.plan.host import compute as host_compute
from plait.plan.host import costs as host_costs
from plait.plan.host.figures import Rate
from plait.plan.host.profile import FORMAT, HostProfile, Section
from plait.plan.host.shapes import block_local
from profile_util import synthetic_profile

MATMUL, ATTENTION, MIX, OVERHEAD = 4e10, 1e10, 5e9, 1e-5  # flat rates: every term computable by hand


def _section(block_rest: tuple[float, float] | None, optimizer: float = 0.0, per_tensor: float = 0.0) -> Section:
    rates = {"matmul": Rate((1.0, 1e12), (MATMUL, MATMUL), (MATMUL / 2, MATMUL / 2)),
             "attention": Rate((1.0, 1e12), (ATTENTION,) * 2, (ATTENTION / 2,) * 2, 0.25),
             "elementwise": Rate((1.0, 1e12), (MIX,) * 2, (MIX / 2,) * 2, 0.4)}
    if block_rest is not None:
        sizes = tuple(float(b * s * h) for b, s, h, *_ in shapes.CALIBRATION_BLOCKS)
        rates["block"] = Rate(sizes, block_rest, tuple(2 * r for r in block_rest), 0.3)
    return Section(1, 2, rates, OVERHEAD, 1e10, {}, optimizer, (), per_tensor)


def _blocks(model, cluster, layout, precision="bf16", shared=False):
    """(layer, embedding, head) per micro-batch from the cluster's host cost model (``shared``: its shared twin)."""
    costs = cluster.costs.shared_twin() if shared else cluster.costs
    b = costs.blocks(model, layout, precision)
    return b.layer, b.embedding, b.head


def _cluster(section: Section) -> Cluster:
    return Cluster.from_profile(HostProfile({"hostname": "h", "cores": 2}, {1: section}), 1)


def test_a_layer_s_elementwise_part_runs_at_the_calibration_blocks_speed():
    """Each block's bytes (as the census counts them) over its seconds beyond GEMMs and attention is the speed;
    a layer between the blocks' bytes per kernel is interpolated, its GEMMs and attention are unchanged."""
    works = [census.layer_work(shapes.block_local(s), 4) for s in shapes.CALIBRATION_BLOCKS]
    speed = 2e9  # bytes/s: both blocks' rest chosen to give it
    rest = tuple(w.elem_bytes / speed for w in works)
    sec = _section(rest)
    block = host_compute.block_elementwise(sec)
    assert block is not None
    assert block.sizes == pytest.approx([w.elem_bytes / w.ops for w in works])
    assert block.alone == pytest.approx([speed, speed]) and block.shared == pytest.approx([speed / 2, speed / 2])
    model = Model.preset("small", seq_len=128)
    layout = Layout(microbatch_size=4)
    with_block, _, _ = _blocks(model, _cluster(sec), layout, "fp32")
    mix, _, _ = _blocks(model, _cluster(_section(None)), layout, "fp32")
    w = census.layer_work(census.local(model, layout), 4)
    gemm = sum(f for f, _ in w.gemms) / MATMUL
    att = w.attention / ATTENTION
    table = w.nograd_ops * OVERHEAD * 0.4  # RoPE's cos/sin tables: forward-only kernels, in both
    assert with_block.f_compute + with_block.b_compute == pytest.approx(3 * gemm + att + w.elem_bytes / speed + table)
    assert mix.f_compute + mix.b_compute == pytest.approx(3 * gemm + att + w.elem_bytes / MIX + w.ops * OVERHEAD
                                                          + table)
    assert with_block.w_compute == mix.w_compute == pytest.approx(gemm)


def _with_layers(sec: Section, alone: tuple[float, float], shared: tuple[float, float]) -> Section:
    """``sec`` with whole calibration layers measured at ``alone`` / ``shared`` times what its kernel figures
    give the same layers."""
    from dataclasses import replace

    from plait.plan.host.figures import LAYER

    model = {x: [host_compute.work_costs(census.layer_work(shapes.block_local(b), 4), sec, x, layer=True)
                 for b in shapes.CALIBRATION_BLOCKS] for x in (False, True)}
    seconds = {x: [c.f_compute + c.b_compute for c in model[x]] for x in (False, True)}
    sizes = tuple(float(b * s * h) for b, s, h, *_ in shapes.CALIBRATION_BLOCKS)
    layer = Rate(sizes, tuple(f * t for f, t in zip(alone, seconds[False], strict=True)),
                 tuple(f * t for f, t in zip(shared, seconds[True], strict=True)), 0.36)
    return replace(sec, rates={**sec.rates, LAYER: layer})


def test_real_layers_set_the_level_of_their_kernels():
    """Where a profile timed whole decoder layers, a layer of a calibration block's shape costs what that
    layer measured (alone, and with every process at once), whatever its kernels' figures say, split between
    forward and backward as it was; between the blocks the factor is interpolated in the log of the kernel
    figures' seconds, flat beyond; a profile without whole layers costs the kernels as they are."""
    from plait.plan.model import llama_ffn

    sec = _section(tuple(2e-3 * (i + 1) for i in range(len(shapes.CALIBRATION_BLOCKS))))
    assert host_compute.in_step(sec, False, 1e-2) == host_compute.in_step(sec, True, 1e-2) == 1.0
    timed = _with_layers(sec, (1.3, 1.1), (0.9, 1.05))
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
    layer, _, _ = _blocks(model, _cluster(timed), Layout(microbatch_size=b), "fp32")
    assert layer.f_compute + layer.b_compute == pytest.approx(timed.rates["layer"].alone[-1])
    plain, _, _ = _blocks(model, _cluster(sec), Layout(microbatch_size=b), "fp32")
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

    base = _with_layers(_section(tuple(2e-3 * (i + 1) for i in range(len(shapes.CALIBRATION_BLOCKS)))),
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
                layer_cost, _, _ = _blocks(model, _cluster(sec), layout, "fp32", shared=is_shared)
                assert layer_cost.recompute == pytest.approx(line(extra))
    assert sh.q == census.local(model, Layout(tp=1, pp=1, dp=1, microbatch_size=2)).q / 2  # tp 2: half the heads
    layout = Layout(tp=1, pp=1, dp=1, microbatch_size=2, recompute="selective")
    w = census.layer_work(census.local(model, layout), 4)
    old_cost, _, _ = _blocks(model, _cluster(base), layout, "fp32")
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

    base = _with_layers(_section(tuple(2e-3 * (i + 1) for i in range(len(shapes.CALIBRATION_BLOCKS)))),
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
    shared, _, _ = _blocks(model, cluster, layout, "fp32", shared=True)
    alone, _, _ = _blocks(model, cluster, layout, "fp32")
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
    sec = _section(rest)
    sec = Section(1, 2, {**sec.rates, "block": Rate(sec.rates["block"].sizes, rest,
                                                      tuple(1.2 * r for r in rest), 0.3)}, OVERHEAD, 1e10)
    block = host_compute.block_elementwise(sec)
    assert block is not None
    assert block.shared == pytest.approx([speed / 2, speed / 2])


def test_block_rest_is_floored_and_other_blocks_ignored():
    """A rest measured as 0 (noise) costs a tenth of the kernel mix's estimate, not nothing; a profile whose
    blocks are not plan.host.shapes' current ones is not used (the mix is)."""
    sec = _section((0.0, 0.0))
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
    timed = _cluster(_section(None, optimizer=3e-9))
    assert step_end.optimizer_time(timed, Layout(), params, 8) == pytest.approx(3e-3)
    with pytest.raises(ConfigError, match="optimizer: 'torch-foreach-adamw' is costed on catalogue GPUs"):
        step_end.optimizer_time(timed, Layout(), params, 8, "torch-foreach-adamw")  # the host times plait's own
    per_tensor = _cluster(_section(None, optimizer=3e-9, per_tensor=3e-5))
    assert step_end.optimizer_time(per_tensor, Layout(), params, 8) == pytest.approx(3e-3 + tensors * 3e-5)
    assert step_end.optimizer_time(per_tensor, Layout(dp=2, zero=1), params, 8) == pytest.approx(
        (3e-3 + tensors * 3e-5) / 2)
    sec2 = _section(None, optimizer=3e-9)
    two = Cluster.from_profile(HostProfile({"hostname": "h", "cores": 2}, {2: Section(2, 1, sec2.rates, OVERHEAD,
                                                                                        1e10, {}, 3e-9)}), 2)
    assert step_end.optimizer_time(two, Layout(dp=2, zero=1), params, 8) == pytest.approx(1.5e-3)
    counted = step_end.optimizer_time(_cluster(_section(None)), Layout(), params, 8)
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
    host = _cluster(_section(None))
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
    sec = _section(tuple(w.elem_bytes / speed for w in works))
    model = Model.preset("small", seq_len=128)
    layout = Layout(microbatch_size=4)
    w = census.layer_work(census.local(model, layout), 4)
    gemm, att, el = sum(f for f, _ in w.gemms) / MATMUL, w.attention / ATTENTION, w.elem_bytes / speed
    table = w.nograd_ops * OVERHEAD * 0.4
    costs = {}
    for share in (0.3, 0.8):
        blocks = replace(sec.rates["block"], forward_share=share)
        layer, _, _ = _blocks(model, _cluster(replace(sec, rates={**sec.rates, "block": blocks})),
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


def _tp_cluster(waits: dict[tuple[int, bool], float | tuple[float, ...]], p: int = 4,
                shapes: tuple = shapes.TP_CALIBRATION_BLOCKS) -> Cluster:
    """A section whose TP layers (plait.calibrate.tp_block) took their twin's time, their collectives as the
    curves time them back to back, and ``waits[(group, sp)]`` more per collective (one figure for every
    shape of ``shapes``, or one per shape)."""
    from plait.plan.host.figures import COLLECTIVES, Curve, TPBlock

    base = _section(None)
    curves = {(op, g): Curve((1024.0, 4e6), (1e-4 * g, 1e-4 * g + 4e6 / 1e9))
              for g in (2, 4) for op in COLLECTIVES if op != "p2p" or g == 2}
    sec = Section(p, 1, base.rates, OVERHEAD, 1e10, curves)
    blocks = []
    for (g, sp), w in waits.items():
        per_shape = w if isinstance(w, tuple) else (w,) * len(shapes)
        for shape, wait in zip(shapes, per_shape, strict=True):
            sh = block_local(shape, g, sp)
            ops = (("all_gather", 4), ("reduce_scatter", 4)) if sp else (("all_reduce", 4),)
            back_to_back = sum(n * sec.collective(op, g, sh.n * 4) for op, n in ops)
            blocks.append(TPBlock(shape, g, sp, 0.03 + back_to_back + wait * (8 if sp else 4), 0.03))
    sec = Section(p, 1, base.rates, OVERHEAD, 1e10, curves, 0.0, tuple(blocks))
    return Cluster.from_profile(HostProfile({"hostname": "h", "cores": 2}, {p: sec}), p)


def test_every_tp_collective_waits_what_the_timed_tp_layer_showed():
    """A TP layer whose collectives took 6 ms each beyond their back-to-back time (plait.calibrate.tp_block:
    the layer less its compute twin, less the curves' collectives) adds 6 ms to every TP collective of a
    run: forward and backward of a layer (4 + 4 under SP, 2 + 2 without), the head's and the embedding's;
    the kernels are unchanged. A negative wait (a curve above what the layer showed) lowers the collectives
    to what the layer showed, never below 0; a group size not timed waits 0, and an older quick calibration's one
    form stands in for the other."""
    extra = 6e-3
    probe = _tp_cluster({})
    cluster = _tp_cluster({(2, False): extra, (4, False): extra, (4, True): extra})
    for n in (1e3, 5e5, 1e7):  # the same wait at both sizes timed: the same at every size
        assert cluster.costs.tp_wait(4, True, n) == pytest.approx(extra)
        assert cluster.costs.tp_wait(2, True, n) == pytest.approx(extra)  # the non-SP form stands in
    assert _tp_cluster({(2, False): -1e-3}).costs.tp_wait(2, False, 5e5) == pytest.approx(-1e-3)
    assert _tp_cluster({(2, False): extra}).costs.tp_wait(4, False, 5e5) == 0.0
    assert probe.costs.tp_wait(2, False, 5e5) == 0.0
    model = Model.preset("small", seq_len=128)
    for sp, (nf, nb) in ((False, (2, 2)), (True, (4, 4))):
        layout = Layout(tp=4, microbatch_size=4, sequence_parallel=sp)
        (layer, embed, head), (l0, e0, h0) = (_blocks(model, c, layout, "fp32")
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
    cluster = _tp_cluster({(2, False): (1e-3, 6e-3)})

    def line(n: float) -> float:
        return 1e-3 + 5e-3 * (n - small) / (large - small)

    for n in (small, large, (small + large) / 2, 2 * large, small / 4):
        assert cluster.costs.tp_wait(2, False, n) == pytest.approx(line(n), abs=1e-12), n
    assert cluster.costs.tp_wait(2, False, small / 4) < 0  # below the line's zero (77 KB)
    assert cluster.costs.tp_wait(2, False, 2 * large) > 6e-3
    model = Model.preset("small", seq_len=128)  # 4x128 tokens of width 256 in fp32: 512 KB
    layout = Layout(tp=2, microbatch_size=4)
    probe = _tp_cluster({(2, False): 0.0})
    (layer, _, _), (l0, _, _) = (_blocks(model, c, layout, "fp32") for c in (cluster, probe))
    assert layer.f_tp - l0.f_tp == pytest.approx(2 * line(4 * 128 * 256 * 4))
    low = _tp_cluster({(2, False): -2e-4})  # the curves 0.2 ms above what the layer showed, per collective
    (layer, _, head), (l0, _, h0) = (_blocks(model, c, layout, "fp32") for c in (low, probe))
    assert l0.f_tp > 4e-4 and h0.b_tp > 2e-4
    assert layer.f_tp - l0.f_tp == pytest.approx(-4e-4) and head.b_tp - h0.b_tp == pytest.approx(-2e-4)
    (layer, embed, head) = _blocks(model, _tp_cluster({(2, False): -1.0}), layout, "fp32")
    assert layer.f_tp == layer.b_tp == head.f_tp == embed.f_tp == 0.0  # never below nothing
    old = _tp_cluster({(2, False): 3e-3}, shapes=shapes.TP_CALIBRATION_BLOCKS[:1])
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
    assert "TP wait 1 MB ms" in text and text.count("(tp") == 2  # sections of 2 and 4 processes; 1 has none
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

    base = _section((1e-3, 4e-3), optimizer=2e-9, per_tensor=2e-5)
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
    host = _cluster(_section(None))
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

    base = _with_layers(_section(tuple(2e-3 * (i + 1) for i in range(len(shapes.CALIBRATION_BLOCKS)))),
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
