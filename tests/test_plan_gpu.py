"""The datasheet GPU cost model (plan.gpu): collectives over a node's NICs, ZeRO-3's traffic on one network beside
the compute, causal flash attention, Megatron-Core's communication overlap, and the shipped constants being the fit
on the published runs."""

import math
from dataclasses import replace

import pytest

from plait.errors import ConfigError
from plait.plan import Cluster, Layout, Model, Training, estimate
from plait.plan.attention import efficiency
from plait.plan.catalogue import LINK_EFFICIENCY, get_gpu
from plait.plan.gpu import FLASH_CAUSAL, gemm_quantization, gemm_speed, gemm_traffic, ring_allreduce
from plait.plan.memory import max_rank_params
from plait.plan.overlap import exposed_tail
from plait.plan.pattern_search import directions
from plait.plan.published import runs
from plait.plan.step_end import dp_sync_parts, tied_sum_time, zero3_collectives
from plait.plan.timing import layer_forward_flops
from plait.plan.validation import default_constants, predict, with_values


def test_a_group_with_several_members_in_a_node_uses_their_nics():
    costs = Cluster("a100-80gb", 64).costs  # 8 nodes of 8, one 25 GB/s HDR NIC per GPU, NVLink3 300 GB/s
    nic = costs.gpu.inter.bandwidth
    assert costs.group_link(8, 8).bandwidth == costs.gpu.intra.bandwidth  # inside a node: NVLink
    assert costs.group_link(8, 64).bandwidth == nic  # DP of a TP8 layout: one member per node, one NIC
    assert costs.group_link(16, 64).bandwidth == 2 * nic  # TP4: two members per node, two NICs
    assert costs.group_link(64, 64).bandwidth == min(8 * nic, costs.gpu.intra.bandwidth)  # all eight
    big = 1e9
    assert costs.collective("all_gather", big, 64) == pytest.approx(
        63 / 64 * big / (8 * nic * LINK_EFFICIENCY) + 63 * costs.gpu.inter.latency)


def test_zero3_gathers_and_reduce_scatter_share_one_network_beside_the_compute():
    """Comm-bound ZeRO-3 (100 Gb/s Ethernet between nodes): each forward takes its gather's time and each
    backward its gather's and reduce-scatter's; what the compute hides is counted once."""
    m = Model(8, 2048, 16, 32000, 2048, glu=True)
    cluster, layout, training = Cluster("a100-80gb", 16, interconnect="eth-100"), Layout(dp=16, zero=3), Training(32)
    e = estimate(m, cluster, layout, training)
    params = max_rank_params(m, layout)
    gather, scatter = zero3_collectives(cluster, layout, params, m.n_layers + 3)  # one of each per block
    compute = e.time["compute"] + e.time["recompute"] + e.time["tp_comm"]
    assert gather > compute  # the regime this checks
    passes = e.time["compute"] + e.time["zero_comm"] + e.time["dp_comm"]
    assert e.microbatches == 2 and passes == pytest.approx(e.microbatches * (2 * gather + scatter), rel=1e-9)


def test_causal_flash_attention_costs_half_the_square_at_its_kernels_published_speed():
    """Head dimension 128 at 4,096 tokens: FlashAttention-2 on the H100 runs at the 294 TFLOP/s its README's
    figure prints (forward + backward, causal), on half the square."""
    m = Model(8, 2048, 16, 32000, 4096, glu=True)
    layout = Layout(dp=8, microbatch_size=2)
    cluster = Cluster("h100-sxm", 8)
    assert cluster.attention == "flash2" and cluster.flash_attention
    block = cluster.costs.blocks(m, layout, "bf16").layer
    gpu, tokens = cluster.gpu, 2 * 4096
    attention = 4 * tokens * 4096 * 2048
    dense = (layer_forward_flops(m, tokens, 4096) - attention) / gemm_speed(gpu)
    (qf, qd, qw), _ = gemm_quantization(gpu, m, layout)  # tile and wave quantization (plan.gemm): none on an H100
    assert block.f_compute - dense / qf > 0
    core = FLASH_CAUSAL * attention / 294e12
    traffic = block.f_compute - dense / qf - core  # the GEMMs' and the element-wise kernels' HBM traffic
    assert traffic > gemm_traffic(gpu, m, layout)[0] > 0
    assert block.b_compute == pytest.approx(dense / qd + dense / qw + 2.5 * core + 2 * traffic)
    # the same layer with FlashAttention v1 (108 TFLOP/s at 2,048 tokens, 126 at 4,096): only the core changes
    slow = Cluster("h100-sxm", 8, flash_attention="flash1").costs.blocks(m, layout, "bf16").layer
    assert slow.f_compute - block.f_compute == pytest.approx(FLASH_CAUSAL * attention * (1 / 126e12 - 1 / 294e12))


def test_attention_efficiency_reads_the_published_figures():
    a100, h100, b200 = get_gpu("a100-80gb"), get_gpu("h100-sxm"), get_gpu("b200")
    assert efficiency(a100, "flash2", 2048, 128) == pytest.approx(155 / 312)  # a printed bar
    # between bars: linear in log2(s) and in the head dimension
    assert efficiency(a100, "flash2", 2 ** 11.5, 128) == pytest.approx((155 + 173) / 2 / 312)
    assert efficiency(a100, "flash2", 2048, 96) == pytest.approx((140 + 155) / 2 / 312)
    assert efficiency(a100, "flash2", 128, 256) == pytest.approx(99 / 312)  # flat beyond the figures
    assert efficiency(h100, "flash1", 65536, 128) == pytest.approx(137 / 989)
    # OpenAI Triton's fused attention on the A100 (the same figure's "FlashAttention Triton" bars): slower than
    # FlashAttention v1's CUDA kernel at head dimension 128 (68 against 69 TFLOP/s at 2k), faster at 64 and 1k
    assert efficiency(a100, "triton-ops", 2048, 128) == pytest.approx(68 / 312)
    assert efficiency(a100, "triton-ops", 1024, 64) == pytest.approx(75 / 312)
    assert efficiency(b200, "flash2", 4096, 128) == b200.flash_efficiency  # no published figure: the guess
    # cuDNN's causal backward is not printed: derived from its forwards' causal loss (16k, head dim 128: forward
    # causal 539, full 595, backward full 516 TFLOP/s, Shah et al. 2024 Figures 5-6)
    backward = 516 * 539 / 595
    assert efficiency(h100, "cudnn", 16384, 128) == pytest.approx(3.5 / (1 / 539 + 2.5 / backward) / 989)


def test_attention_kernel_choices_are_checked():
    assert Cluster("a100-80gb", 8, flash_attention=False).attention == "unfused"
    assert Cluster("a100-80gb", 8, flash_attention="flash1").attention == "flash1"
    assert Cluster("b200", 8, flash_attention="flash3").attention == "flash3"  # no figures: any kernel
    with pytest.raises(ConfigError, match="flash_attention: 'flash3' runs on Hopper GPUs only; valid on a100-80gb: "
                                          "flash1, triton-ops, flash2, True, False"):
        Cluster("a100-80gb", 8, flash_attention="flash3")
    with pytest.raises(ConfigError, match="'triton-ops' has no published speed on h100-sxm"):
        Cluster("h100-sxm", 8, flash_attention="triton-ops")
    with pytest.raises(ConfigError, match="'cudnn' has no published speed on a100-40gb"):
        Cluster("a100-40gb", 8, flash_attention="cudnn")
    with pytest.raises(ConfigError, match="flash_attention: unknown kernel 'fa2'.*flash2"):
        Cluster("h100-sxm", 8, flash_attention="fa2")


def test_shipped_constants_are_the_fit_on_the_published_runs():
    """The catalogue's constants are where ``plan.validation``'s fit (every source in, all constants together)
    puts them, rounded: no step of 1% in any of them, or in any two together (the A100 ceiling and the element-wise
    traffic trade off along a flat valley), lowers the mean |log error| over the published runs by 1e-4."""
    rs, constants = runs(), default_constants()
    shipped = {c.name: getattr(next(r for r in rs if c.uses(r)).cluster.gpu, c.name.split("[")[0])
               for c in constants}
    seen: dict[tuple, float] = {}

    def loss(values):
        total = 0.0
        for i, r in enumerate(rs):
            key = (i, *(values[c.name] for c in constants if c.uses(r)))
            if key not in seen:
                seen[key] = predict(with_values(r, constants, values))
            total += abs(math.log(seen[key] / r.step_s))
        return total / len(rs)

    here = loss(shipped)
    for d in directions(len(constants)):
        moved = {c.name: shipped[c.name] * 1.01 ** k for c, k in zip(constants, d, strict=True)}
        assert loss(moved) > here - 1e-4, d


def test_zero3_pays_a_collectives_latency_per_block():
    """ZeRO-3 gathers (and reduce-scatters) block by block: each is a collective of its own and pays the ring's
    latency, (n - 1) hops, which over thousands of ranks outweighs a block's bytes."""
    m, cluster = Model.preset("llama3-8b", seq_len=2048), Cluster("h100-sxm", 4096)
    layout = Layout(tp=8, pp=1, dp=512, zero=3)
    params = max_rank_params(m, layout)
    one_g, one_s = zero3_collectives(cluster, layout, params, 1)
    blocks_g, blocks_s = zero3_collectives(cluster, layout, params, m.n_layers + 3)
    hop = cluster.gpu.inter.latency
    assert blocks_g - one_g == pytest.approx((m.n_layers + 2) * 511 * hop)
    assert blocks_s - one_s == pytest.approx((m.n_layers + 2) * 511 * hop)
    e = estimate(m, cluster, layout, Training(4096))
    assert e.time["zero_comm"] > 0  # at 512 ranks the per-block latency is no longer hidden behind the compute


def test_full_recomputation_of_the_layers_only_leaves_the_head_out():
    """Megatron-LM, DeepSpeed's pipeline, llm-foundry and torchtitan checkpoint the transformer layers only:
    ``Training(recompute_head=False)`` drops the head's second forward, 2·s·h·V FLOPs a micro-batch, from the step
    of a stack whose checkpoint re-runs what it wraps whole. plait's runtime checkpoints the head's block too (the
    default), but its early-stopping checkpoint stops before the output layer's GEMM: nothing of it again."""
    m = Model(4, 1024, 8, 32000, 1024)
    cluster, layout = Cluster("a100-80gb", 1), Layout(recompute="full")
    ours = estimate(m, cluster, layout, Training(4, recompute_early_stop=False))
    layers_only = estimate(m, cluster, layout, Training(4, recompute_head=False, recompute_early_stop=False))
    plaits = estimate(m, cluster, layout, Training(4))
    assert plaits.time["recompute"] == estimate(m, cluster, layout, Training(4, recompute_head=False)).time["recompute"]
    g = cluster.gpu
    # [1024, 1024] x [1024, 32000]: 67.1 GFLOP at the ceiling, 1,000 tiles of 256x128 in 10 waves of 108 SMs;
    # its operands and result, 2·(1024·1024 + 2·1024·32000) = 133,169,152 bytes at 2.039 TB/s, 65.3 µs
    assert gemm_quantization(g, m, layout)[1][0] == pytest.approx(1000 / 1080)
    head = 2 * 1024 * 1024 * 32000 / (312e12 * g.matmul_efficiency * 1000 / 1080) + 133_169_152 / 2.039e12
    assert ours.time["recompute"] - layers_only.time["recompute"] == pytest.approx(4 * head, rel=1e-9)
    assert ours.step_time_s - layers_only.step_time_s == pytest.approx(4 * head, rel=1e-9)
    with pytest.raises(ConfigError, match="recompute_head"):  # plait's runtime would recompute it
        layout.to_parallel_config(Training(4, recompute_head=False))
    unchanged = Layout(recompute="selective")
    assert estimate(m, cluster, unchanged, Training(4)).step_time_s == estimate(
        m, cluster, unchanged, Training(4, recompute_head=False)).step_time_s


def _sp_layer(gpu, hidden: int, t: int) -> tuple[Model, Layout, float, tuple[float, ...]]:
    """One dense layer at tp ``t`` with SP on 8 H100s, worked by hand: the model (MHA, a GLU MLP of 3h), its layout,
    one SP gather's (or scatter's) seconds over NVLink and its four GEMMs' (QKV, projection, up, down)."""
    m = Model(4, hidden, 16, 32000, 2048, ffn_hidden=3 * hidden, glu=True)  # MHA: QKV is h x 3h
    link, speed = gpu.intra, gemm_speed(gpu)
    c = (t - 1) / t * 2048 * hidden * 2 / (link.bandwidth * LINK_EFFICIENCY) + (t - 1) * link.latency
    gemms = tuple(2 * 2048 * hidden * k * hidden / t / speed for k in (3, 1, 6, 3))
    return m, Layout(tp=t, dp=8 // t, sequence_parallel=True), c, gemms


def test_tp_comm_overlap_hides_sequence_parallel_collectives_under_their_gemms():
    """Userbuffers' decomposition (Wang et al. 2023), worked by hand on one layer at tp4 with SP. Comm-bound
    (hidden 1024: a gather outlasts its GEMM): each gather and pipelined scatter of the forward hides 3/4 of its
    GEMM's time; the backward's bulk overlaps hide all of theirs. GEMM-bound (hidden 8192, tp2): only the last of
    each scatter's 4 pieces shows, nothing of the backward. The pipelined scatters' kernels hold 16 of the 132
    SMs: their GEMMs run 132/116 times as long. Without SP the flag changes nothing."""
    cluster = Cluster("h100-sxm", 8)
    costs, gpu = cluster.costs, cluster.gpu
    for hidden, t in ((1024, 4), (8192, 2)):
        m, layout, c, (qkv, proj, up, down) = _sp_layer(gpu, hidden, t)
        plain = costs.blocks(m, layout, "bf16").layer
        over = costs.blocks(m, layout, "bf16", tp_overlap=True).layer
        assert plain.f_tp == pytest.approx(4 * c) and plain.b_tp == pytest.approx(4 * c)
        if hidden == 1024:
            assert c > up  # comm-bound: every collective outlasts its GEMM
            k = 132 / 116  # scatter: (k - 1) g + c/4 + 3/4 (c - k g) = c + (k/4 - 1) g
            assert over.f_tp == pytest.approx(4 * c - 0.75 * (qkv + up) + (k / 4 - 1) * (proj + down))
            assert over.b_tp == pytest.approx(6 * c - 2 * qkv - 2 * up - 0.75 * (proj + down))
        else:
            assert c < proj / 2  # GEMM-bound
            assert over.f_tp == pytest.approx(2 * c / 4 + (132 / 116 - 1) * (proj + down)) and over.b_tp == 0.0
        no_sp = Layout(tp=t, dp=8 // t)
        assert costs.blocks(m, no_sp, "bf16", tp_overlap=True).layer == costs.blocks(m, no_sp, "bf16").layer
    with pytest.raises(ValueError, match="tp_comm_overlap"):
        Training(8, tp_comm_overlap=1)
    with pytest.raises(ConfigError, match="tp_comm_overlap"):  # plait's runtime runs its collectives exposed
        Layout(tp=2, dp=4, sequence_parallel=True).to_parallel_config(Training(8, tp_comm_overlap=True))


def test_sp_async_backward_hides_the_column_parallel_collectives_behind_their_backward_gemms():
    """``Training.sp_async_backward`` (apex's column-parallel layers, which NeMo 1.11.0 runs): the input gathered
    again beside the data-gradient GEMM and its gradient reduce-scattered beside the weight-gradient GEMM, each
    exposed only beyond that GEMM; the row-parallel layers' gradient gathers stay exposed, the forward unchanged.
    Worked by hand on one layer at tp4 with SP, comm-bound (hidden 1024) and GEMM-bound (hidden 8192, tp2). Without
    SP, or under userbuffers (``tp_comm_overlap``), the flag changes nothing; plait's runtime does not run it."""
    cluster = Cluster("h100-sxm", 8)
    costs, gpu = cluster.costs, cluster.gpu
    for hidden, t in ((1024, 4), (8192, 2)):
        m, layout, c, (qkv, _, up, _) = _sp_layer(gpu, hidden, t)
        plain = costs.blocks(m, layout, "bf16").layer
        sp_async = costs.blocks(m, layout, "bf16", sp_async=True).layer
        assert sp_async.f_tp == plain.f_tp == pytest.approx(4 * c)
        if hidden == 1024:
            assert c > up  # comm-bound: each collective shows what it takes beyond its GEMM
            assert sp_async.b_tp == pytest.approx(2 * c + 2 * (c - qkv) + 2 * (c - up))
        else:
            assert c < qkv  # GEMM-bound: the column-parallel layers' four collectives hidden
            assert sp_async.b_tp == pytest.approx(2 * c)
        no_sp = Layout(tp=t, dp=8 // t)
        assert costs.blocks(m, no_sp, "bf16", sp_async=True).layer == costs.blocks(m, no_sp, "bf16").layer
        over = costs.blocks(m, layout, "bf16", tp_overlap=True).layer
        assert costs.blocks(m, layout, "bf16", tp_overlap=True, sp_async=True).layer == over
    nemo = [r for r in runs() if r.source == "NVIDIA NeMo Megatron" and r.layout.sequence_parallel]
    assert len(nemo) == 5 and all(r.training.sp_async_backward for r in nemo)
    exposed = replace(nemo[0], training=replace(nemo[0].training, sp_async_backward=False))
    assert predict(nemo[0]) < predict(exposed)  # the estimate follows the flag
    with pytest.raises(ConfigError, match="sp_async_backward"):  # plait's runtime runs its collectives exposed
        Layout(tp=2, dp=4, sequence_parallel=True).to_parallel_config(Training(8, sp_async_backward=True))


def test_dp_collectives_hide_chunk_by_chunk_behind_the_passes_beside_them():
    """A 2 s reduction over 4 chunks in a 2-stage interleaved pipeline, 0.5 s of backward per micro-batch: the
    chunks' quarter-second slots open 0.875, 0.625, 0.375 and 0.125 s before the backward ends; one network
    runs the 0.5 s pieces in turn from -0.875 s, the last ends 1.125 s after the backward. One chunk: what
    outlasts the window. With the weights' gather hidden behind a forward that outlasts it, only the
    reduction's exposed part is left of dp_comm."""
    assert exposed_tail(2.0, 0.5, 4, 2) == pytest.approx(1.125)
    assert exposed_tail(1.0, 0.5, 4, 2) == pytest.approx(0.125)  # the last chunk's piece beyond its own slot
    assert exposed_tail(1.0, 0.5) == pytest.approx(0.5) and exposed_tail(0.2, 0.5) == 0.0
    m, cluster = Model.preset("llama3-8b", seq_len=4096), Cluster("h100-sxm", 64)
    layout = Layout(tp=2, dp=32, sequence_parallel=True, zero=1)
    params = max_rank_params(m, layout)
    reduction, gather = dp_sync_parts(m, cluster, layout, params)
    plain, ahead = (estimate(m, cluster, layout, Training(64, overlap_param_gather=o)) for o in (False, True))
    assert 0 < gather < plain.time["compute"] / plain.microbatches / 3  # one forward hides the whole gather
    assert plain.time["dp_comm"] - ahead.time["dp_comm"] == pytest.approx(gather)
    assert sum(ahead.phases.values()) == pytest.approx(ahead.step_time_s)
    with pytest.raises(ConfigError, match="overlap_param_gather"):
        layout.to_parallel_config(Training(64, overlap_param_gather=True))


def test_plaits_bf16_copies_reduce_after_each_chunks_own_backward_under_a_split_backward():
    """Without a chunk's own last backward to hide behind (plait's bf16 copies of fp32 parameters under a
    zero-bubble schedule hand the gradients to the buckets after it): a 2 s reduction over 4 chunks of a 2-stage
    pipeline, 0.5 s pieces from the slots 0.75, 0.5, 0.25 and 0 s before the backward ends, the last ends 1.25 s
    after it; one chunk waits for all of it. Other schedules hand each reduced bucket over when it is complete
    and keep the overlap, as do ZeRO-1 (bf16 parameters, no copies) and fp32 runs."""
    assert exposed_tail(2.0, 0.5, 4, 2, own=False) == pytest.approx(1.25)
    assert exposed_tail(1.0, 0.5, own=False) == pytest.approx(1.0)
    m, cluster = Model.preset("llama3-8b", seq_len=4096), Cluster("h100-sxm", 64)
    for zero, schedule in ((0, "zb-h1"), (0, "1f1b"), (1, "zb-h1")):
        layout = Layout(tp=2, pp=2, dp=16, sequence_parallel=True, zero=zero, schedule=schedule)
        reduction, _ = dp_sync_parts(m, cluster, layout, max_rank_params(m, layout))
        bf16, fp32 = (estimate(m, cluster, layout, Training(64, precision=p)) for p in ("bf16", "fp32"))
        if (zero, schedule) == (0, "zb-h1"):
            assert bf16.time["dp_comm"] == pytest.approx(reduction)
        else:
            assert bf16.time["dp_comm"] < reduction
        assert fp32.time["dp_comm"] < reduction

def test_pipelined_scatters_hold_the_sms_their_configuration_sets():
    """``Training.tp_overlap_sms``: the reduce-scatter after the output projection holds its own SM count and the
    one after the MLP's last GEMM its own (NeMo's Llama 3.1 405B configuration: 24 and 8 of the H100's 132), so
    the projection runs 132/108 and the last GEMM 132/124 times as long. GEMM-bound layer (hidden 8192, tp2): only
    the last of each scatter's 4 pieces shows besides."""
    cluster = Cluster("h100-sxm", 8)
    m = Model(4, 8192, 16, 32000, 2048, ffn_hidden=3 * 8192, glu=True)
    layout = Layout(tp=2, dp=4, sequence_parallel=True)
    link, speed = cluster.gpu.intra, gemm_speed(cluster.gpu)
    c = 1 / 2 * 2048 * 8192 * 2 / (link.bandwidth * LINK_EFFICIENCY) + link.latency
    proj, down = 2 * 2048 * 8192 * 8192 / 2 / speed, 2 * 2048 * 3 * 8192 * 8192 / 2 / speed
    own = cluster.costs.blocks(m, layout, "bf16", tp_overlap=True, overlap_sms=(24, 8)).layer
    assert own.f_tp == pytest.approx(2 * c / 4 + (132 / 108 - 1) * proj + (132 / 124 - 1) * down)
    default = cluster.costs.blocks(m, layout, "bf16", tp_overlap=True).layer  # Transformer Engine's 16 each
    assert default.f_tp == pytest.approx(2 * c / 4 + (132 / 116 - 1) * (proj + down))
    for bad in ((0, 16), (16, 33), (16,), (16.0, 16)):
        with pytest.raises(ConfigError, match=r"tp_overlap_sms: must be two integers from 1 to 32"):
            Training(8, tp_overlap_sms=bad)
    with pytest.raises(ConfigError, match="tp_overlap_sms"):  # plait's runtime runs no userbuffers
        Layout(tp=2, dp=4, sequence_parallel=True).to_parallel_config(Training(8, tp_overlap_sms=(24, 8)))
    with pytest.raises(ConfigError, match="no SM count"):
        Cluster("b200", 8).costs.blocks(m, layout, "bf16", tp_overlap=True)


def test_context_parallel_ring_hides_each_transfer_behind_one_steps_attention_at_the_kernels_speed():
    """Transformer Engine's p2p ring by hand: 4 CP ranks of a TP8 layout, one per node, each on one 50 GB/s NIC
    (80% of it). A rank holds 2,048 of the 8,192 tokens and the one KV head of its TP rank: 2048·2·128·2 B = 1 MiB
    of K and V. Each of the 4 steps runs half of a 2,048² block on 32/8 heads of dimension 128, 4.3 GFLOP, at
    FlashAttention-2's 265 TFLOP/s (H100, 2,048 tokens): 16.2 µs forward, 2.5 times that backward. Forward: 3
    transfers of 1 MiB (31.2 µs), each beside one step. Backward: 4 transfers, each beside one step's backward
    (40.5 µs): K/V alone first and dK/dV alone last (hidden), both in between (2 MiB, 57.4 µs: 16.9 µs shows)."""
    m = Model(2, 4096, 32, 32000, 8192, ffn_hidden=14336, n_kv_heads=8, glu=True)
    cluster, layout = Cluster("h100-sxm", 32), Layout(tp=8, cp=4, cp_comm="ring")
    block = 2048 * 2 * 128 * 2
    one, two = (n * block / (50e9 * LINK_EFFICIENCY) + 5e-6 for n in (1, 2))
    step = FLASH_CAUSAL * 4 * 2048 * 8192 * 4096 / 8 / 4 / 265e12
    assert step < one < 2.5 * step < two  # the regime this checks
    tp = 2 * ring_allreduce(2048 * 4096 * 2, 8, cluster.gpu.intra)
    layer = cluster.costs.blocks(m, layout, "bf16").layer
    assert layer.f_tp == pytest.approx(tp + 3 * (one - step))
    assert layer.b_tp == pytest.approx(tp + 2 * (two - 2.5 * step))


def test_tied_embedding_gradient_is_summed_over_the_first_and_last_stage_once_a_step():
    """32000 x 2048 fp16 gradients (131.072 MB) all-reduced by the two ends of a pp2 pipeline on two nodes: each
    moves the tensor once over its HDR NIC (25 GB/s at 0.8) plus two latencies of 5 us; plait sums its ZeRO-1
    shard, 1/8 of it."""
    m = Model(4, 2048, 16, 32000, 2048, tied_embeddings=True)
    cluster, layout = Cluster("a100-80gb", 16, interconnect="ib-hdr"), Layout(pp=2, dp=8, zero=1)
    full = 131.072e6 / 20e9 + 2 * 5e-6
    shard = 131.072e6 / 8 / 20e9 + 2 * 5e-6
    assert tied_sum_time(m, cluster, layout, "fp16", "full") == pytest.approx(full)
    assert tied_sum_time(m, cluster, layout, "fp16", "shard") == pytest.approx(shard)
    assert tied_sum_time(replace(m, tied_embeddings=False), cluster, layout, "fp16", "full") == 0.0
    assert tied_sum_time(m, cluster, Layout(dp=16, zero=1), "fp16", "full") == 0.0
    sync = {w: estimate(m, cluster, layout, Training(64, grad_dtype="fp16", tied_grad_sum=w)).time["sync"]
            for w in ("full", "shard")}
    assert sync["full"] - sync["shard"] == pytest.approx(full - shard)
    with pytest.raises(ConfigError, match="tied_grad_sum"):
        Training(64, tied_grad_sum="half")
    with pytest.raises(ConfigError, match="tied_grad_sum"):
        layout.to_parallel_config(Training(64, tied_grad_sum="full"))


def test_selective_recomputation_of_an_unfused_core_redoes_its_softmax_and_dropout():
    """Selective recomputation runs the checkpointed unfused core again whole (Korthikanti et al. 2022, §5; NeMo
    1.11.0's checkpointed CoreAttention): QK^T and AV at the GEMM speed, and the softmax and dropout over the s×s
    scores, whose bytes (5·a·s² a sequence: scores, probabilities, dropout mask) are what it does not keep, at
    the fitted element-wise traffic."""
    m = Model(4, 1024, 8, 32000, 1024, dropout=True)
    cluster = Cluster("a100-80gb", 1, flash_attention=False)
    g = cluster.gpu
    layer = cluster.costs.blocks(m, Layout(microbatch_size=2, recompute="selective"), "bf16").layer
    gemms = 4 * (2 * 1024) * 1024 * 1024 / gemm_speed(g)  # 4·T·s·h FLOPs over T = 2 x 1024 tokens
    scores = 5 * 8 * 1024 ** 2 * 2  # 5·a·s²·b bytes
    assert layer.recompute == pytest.approx(gemms + g.elementwise_traffic * scores / g.memory_bandwidth, rel=1e-12)
