"""plait's own eager element-wise kernels (``plan.eager``): a hand-worked tiny layer, the count beside the torch
profile of one plait training step on an H200, and ``Training(elementwise="plait-eager")`` in the GPU model."""

from dataclasses import replace

import pytest

from calibrated_util import host_cluster, host_section
from plait.errors import ConfigError
from plait.parallel_config import ParallelConfig
from plait.plan import Cluster, Layout, Model, Training, eager, estimate
from plait.plan.accumulation import traffic
from plait.plan.catalogue import GPUS
from plait.plan.memory import activation_bytes_per_layer
from plait.plan.runs import train_layout
from plait.plan.step_end import param_tensors

# This project's own measurement (bench/gpu_check.py, ``make gpu-check``), 2026-11-27, one NVIDIA H200, torch
# 2.11.0+cu130: torch.profiler over ONE plait training step (zero_grad, train_step, fused AdamW with clip 1.0) of
# its 0.6B Llama (20 layers, hidden 1536, 12 heads, 4 KV heads, ffn 4096, vocabulary 32,000), batch 4 x 2048
# tokens, bf16 over fp32 master weights, one GPU; its ``profile.txt``, sorted by self CUDA time (25 rows).
# aten operator: (self CUDA ms, calls)
PROFILE_OPS = {"mul": (11.356, 344), "copy_": (10.394, 485), "add_": (4.983, 284), "roll": (3.155, 80),
               "add": (2.614, 120)}
# of copy_'s calls: aten::_to_copy 353, aten::clone 132 (from the same run's host-time table)
# generic (strided) ``elementwise_kernel<128, 4, ...>`` rows of that table: (ms, calls); their names are cut off
PROFILE_STRIDED = [(7.012, 242), (2.982, 120), (2.425, 80)]
H200_BANDWIDTH = 4.8e12  # the catalogue's (the datasheet's) HBM bandwidth
GPU_CHECK_MODEL = Model(n_layers=20, hidden=1536, n_heads=12, vocab=32000, seq_len=2048, ffn_hidden=4096,
                        n_kv_heads=4, glu=True)
GPU_CHECK_LAYOUT = Layout(microbatch_size=4)


def step_kernels() -> list[eager.Kernel]:
    """Every counted element-wise kernel of the gpu-check step: 20 layers, the head and loss, the bf16 casts of the
    parameters and their gradients' adds into the fp32 buckets (one add per tensor, ``plan.accumulation``'s bytes)."""
    m, lay, n = GPU_CHECK_MODEL, GPU_CHECK_LAYOUT, GPU_CHECK_MODEL.n_layers
    out = [replace(k, calls=k.calls * n, nbytes=k.nbytes * n) for k in eager.layer_kernels(m, lay, "bf16")]
    tensors, params = param_tensors(n), m.n_params()
    out += eager.head_kernels(m, lay, "bf16") + eager.step_kernels(params, tensors, "bf16", 0)
    return out + [eager.Kernel("add_", "backward", tensors, traffic("plait", "bf16", 0).every * params)]


def test_a_tiny_layers_bytes_by_hand():
    """T = 4 tokens, h = 8, 2 heads of 4 (q = 8), 1 KV head (kv = 4), ffn 16, bf16 (a = 2): norm elements n = 32,
    query 32, key 16, MLP 64. Bytes per element of each kernel: a norm forward x.float() 6, rms_norm 8, .to 6,
    weight·y 4 (24); backward grad·y 6, its sum 2, grad·w 4, the two casts back 6 + 6, rms_norm's 12 (36). RoPE
    on one tensor: x·cos 4, roll's copy 4, roll 4, roll·sin 4, add 6 (22) each way. Residual adds 6 each; silu 4,
    silu·up 6; backward two products 6 + 6, silu's 6; five sums of a [T, h] gradient 6 each; the two backward
    copies of q's and k's gradient 4 each."""
    m = Model(n_layers=1, hidden=8, n_heads=2, vocab=32, seq_len=4, ffn_hidden=16, n_kv_heads=1, glu=True)
    ks = eager.layer_kernels(m, Layout(), "bf16")
    forward = 2 * 24 * 32 + 22 * 32 + 22 * 16 + 2 * 6 * 32 + (4 + 6) * 64
    backward = 2 * 36 * 32 + 22 * 32 + 22 * 16 + (6 + 6 + 6) * 64 + 5 * 6 * 32 + 4 * (32 + 16)
    assert (forward, backward) == (3616, 5664)
    assert eager.seconds(ks, 1.0) == (forward, backward)
    # fp32 (a = 4): no casts; a norm forward 8 + 8, backward 12 + 4 + 8 + 12
    ks32 = eager.layer_kernels(m, Layout(), "fp32")
    forward32 = 2 * 16 * 32 + 44 * 32 + 44 * 16 + 2 * 12 * 32 + (8 + 12) * 64
    assert eager.seconds(ks32, 1.0)[0] == forward32
    assert all(k.strided for k in ks32 if k.op == "copy_")  # only the layout copies are left
    # the head: a norm, then the loss over [4, 32] logits: cast 6, max 4, sub 8, exp 8, sum 4, div_ 8; backward
    # clone 8, scale 8, cast 6
    head = eager.seconds(eager.head_kernels(m, Layout(), "bf16"), 1.0)
    assert head == (24 * 32 + (6 + 4 + 8 + 8 + 4 + 8) * 128, 36 * 32 + (8 + 8 + 6) * 128)


def test_the_count_beside_the_h200_profile_of_one_plait_step():
    """Launches per operator as the profile counted them; bytes at the datasheet bandwidth as a lower bound.

    Call counts: mul and roll exactly. add + add_: one launch more in the profile than counted (the two split by
    whether autograd sums a gradient in place; one add_ of the step is not attributed). copy_: 15 of 485 not
    attributed (11 clones, 4 casts: the step end's scalars, the norm's float64 sums), so the count may be at most
    4% short. Time: the kernels with a broadcast or strided operand (``Kernel.strided``: 242 bf16 products, 120
    copies, 80 sums, as many as the profile's three generic elementwise_kernel rows have calls) run at 28-35% of
    the bandwidth, the other products at about 83%, so the five classes take about twice their bytes' time at the
    datasheet bandwidth. This test holds the count and how far the profile's time is from those bytes at the
    datasheet bandwidth; the planner charges each kind at the speed gpu-check's elementwise section measured it
    alone (``tests/test_plan_own_gpu.py`` sets that beside these rows)."""
    ks = step_kernels()
    ops = eager.by_op(ks)
    assert ops["mul"][0] == PROFILE_OPS["mul"][1] and ops["roll"][0] == PROFILE_OPS["roll"][1]
    adds = ops["add"][0] + ops["add_"][0]
    assert abs(adds - (PROFILE_OPS["add"][1] + PROFILE_OPS["add_"][1])) <= 1
    assert 0.96 * PROFILE_OPS["copy_"][1] <= ops["copy_"][0] <= PROFILE_OPS["copy_"][1]
    # the generic kernels: bf16 products (the loss's float32 one is another instantiation), copies, sums
    strided = [k for k in ks if k.strided and not (k.op == "mul" and k.nbytes == 8 * 4 * 2048 * 32000)]
    calls = {op: sum(k.calls for k in strided if k.op in ops_) for op, ops_ in
             (("mul", ("mul",)), ("copy_", ("copy_",)), ("add", ("add", "add_")))}
    assert calls == {"mul": 242, "copy_": 120, "add": 80}

    def ms(op: str) -> float:
        return ops[op][1] / H200_BANDWIDTH * 1e3

    for op in ("mul", "copy_", "roll"):
        assert ms(op) < PROFILE_OPS[op][0]
    measured = sum(t for t, _ in PROFILE_OPS.values())
    counted = ms("mul") + ms("copy_") + ms("roll") + ms("add") + ms("add_")
    assert 1.7 < measured / counted < 2.4
    contiguous_mul = sum(k.nbytes for k in ks if k.op == "mul" and not k.strided) / H200_BANDWIDTH * 1e3
    contiguous_mul += 8 * 4 * 2048 * 32000 / H200_BANDWIDTH * 1e3  # the loss's float32 product (not in a row)
    assert 1.0 < (PROFILE_OPS["mul"][0] - PROFILE_STRIDED[0][0]) / contiguous_mul < 1.25
    strided_ms = sum(k.nbytes for k in strided) / H200_BANDWIDTH * 1e3
    assert 2.5 < sum(t for t, _ in PROFILE_STRIDED) / strided_ms < 4.0


def test_plait_eager_replaces_the_fitted_term_in_the_gpu_model():
    """On the gpu-check run the step grows by the counted kernels' seconds (at the H200's measured rates) less the
    fitted term's (3 passes of 1.63 x a layer's stored bytes, each layer), nothing else; full recomputation
    repeats the counted forward of each layer and of the final norm (plait's checkpoint stops before the output
    layer: no loss kernel again)."""
    m, lay, gpu = GPU_CHECK_MODEL, GPU_CHECK_LAYOUT, GPUS["h200"]
    cluster = Cluster("h200", 1, gpus_per_node=1)
    fused = estimate(m, cluster, lay, Training(4), exact=True)
    own = estimate(m, cluster, lay, Training(4, elementwise="plait-eager"), exact=True)
    bandwidth, rates = gpu.memory_bandwidth, gpu.elementwise_rates
    layer_f, layer_b = eager.seconds(eager.layer_kernels(m, lay, "bf16"), bandwidth, rates)
    head_f, head_b = eager.seconds(eager.head_kernels(m, lay, "bf16"), bandwidth, rates)
    norm_f = eager.seconds(eager.rms_norm(lay.microbatch_size * m.seq_len * m.hidden, 2), bandwidth, rates)[0]
    fitted = 3 * gpu.elementwise_traffic * activation_bytes_per_layer(m, replace(lay, recompute="selective")) \
        / gpu.memory_bandwidth
    grown = m.n_layers * (layer_f + layer_b - fitted) + head_f + head_b
    assert own.step_time_s - fused.step_time_s == pytest.approx(grown, rel=1e-9)
    assert own.time["optimizer"] == fused.time["optimizer"]
    full = replace(lay, recompute="full")
    own_full = estimate(m, cluster, full, Training(4, elementwise="plait-eager"), exact=True)
    fused_full = estimate(m, cluster, full, Training(4), exact=True)
    assert own_full.time["recompute"] - fused_full.time["recompute"] == pytest.approx(
        m.n_layers * (layer_f - fitted / 3) + norm_f, rel=1e-9)


def test_plaits_runs_are_costed_eager_and_the_default_stays_fused():
    """``plait train``'s prediction (``train_layout``) costs plait's kernels; ``Training``'s default is the fitted
    term every published row is costed with; a calibrated host ignores the field; a bad value names the choices."""
    _, training = train_layout(ParallelConfig(tp=1, pp=1, dp=1, precision="bf16").resolve(1), 4)
    assert training.elementwise == eager.RUNTIME_ELEMENTWISE == "plait-eager"
    assert Training(4).elementwise == "fused"
    with pytest.raises(ConfigError, match="elementwise='triton': not one of fused, plait-eager"):
        Training(4, elementwise="triton")
    small = Model(n_layers=2, hidden=64, n_heads=4, vocab=128, seq_len=32, glu=True)
    host = host_cluster(host_section(None))
    a = estimate(small, host, Layout(), Training(1), exact=True)
    b = estimate(small, host, Layout(), Training(1, elementwise="plait-eager"), exact=True)
    assert a.step_time_s == b.step_time_s


def test_plait_eager_memory_is_what_plaits_layers_save():
    """Under "plait-eager" a catalogue GPU's activations are plait's own, tensor by tensor (the census a calibrated
    host uses, ``eager_activations``), not Korthikanti et al.'s fused count: on the gpu-check run (one micro-batch
    of 4 x 2048 tokens) each bf16 layer also keeps its two norms' float32 inputs (8 bytes a token and channel),
    RoPE's and SwiGLU's operands; the published rows keep the fused count."""
    from plait.plan.host.costs import eager_activations

    m, lay = GPU_CHECK_MODEL, GPU_CHECK_LAYOUT
    cluster = Cluster("h200", 1, gpus_per_node=1)
    own = estimate(m, cluster, lay, Training(4, elementwise="plait-eager"), exact=True).memory
    fused = estimate(m, cluster, lay, Training(4), exact=True).memory
    acts = eager_activations(m, lay, "bf16")
    assert own.activations == pytest.approx(acts.chunk(m.n_layers, True, True) + acts.shared + acts.working)
    tokens = 4 * 2048
    assert acts.layer - cluster.costs.activations(m, lay, "bf16").layer > 2 * 4 * tokens * m.hidden
    assert own.activations > 1.3 * fused.activations
    assert fused.activations == pytest.approx(cluster.costs.activations(m, lay, "bf16").chunk(m.n_layers, True, True))


def test_plait_eager_backward_gathers_each_sp_regions_input_again():
    """plait's runtime keeps an SP region's input as its sequence shard and all-gathers it again in the backward
    (``plait.tensor_parallel.regather``): under "plait-eager" a dense layer's backward TP time grows by two ring
    all-gathers of its bf16 [T, h] input over tp, by hand; none under full recomputation (whole blocks keep the
    gathered input) or without SP; the fused rows (Megatron-LM, whose re-gather overlaps its data-gradient GEMM)
    are unchanged."""
    m = GPU_CHECK_MODEL
    cluster = Cluster("h100-sxm", 8)
    costs = cluster.costs
    tokens, t = 4 * 2048, 4
    link = cluster.link(t)
    gather = (t - 1) / t * tokens * m.hidden * 2 / (link.bandwidth * 0.8) + (t - 1) * link.latency
    for recompute, regathers in (("none", 2), ("selective", 2), ("full", 0)):
        lay = Layout(tp=t, microbatch_size=4, sequence_parallel=True, recompute=recompute)
        own = costs.blocks(m, lay, "bf16", elementwise="plait-eager").layer
        fused = costs.blocks(m, lay, "bf16").layer
        assert own.b_tp - fused.b_tp == pytest.approx(regathers * gather, rel=1e-9)
        assert own.f_tp == fused.f_tp
    no_sp = Layout(tp=t, microbatch_size=4)
    own_b = costs.blocks(m, no_sp, "bf16", elementwise="plait-eager").layer.b_tp
    assert own_b == costs.blocks(m, no_sp, "bf16").layer.b_tp
