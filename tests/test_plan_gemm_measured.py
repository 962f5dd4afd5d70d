"""The GEMM cost by shape (plan.gemm, plan.gpu) against GEMM speeds measured on an H200 (plan.measured_gemm_h200),
and its memory-traffic term worked by hand on a small layer."""

import statistics
from statistics import correlation

import pytest

from plait.plan import Cluster, Layout, Model
from plait.plan.catalogue import GPU, get_gpu
from plait.plan.gemm import gemm_seconds, operand_bytes, quantization, scaled_error
from plait.plan.gpu import UNQUANTIZED, gemm_quantization, gemm_traffic
from plait.plan.measured_gemm_h200 import GRID, PUBLISHED, Measured
from plait.plan.published import runs
from plait.plan.timing import head_gemm, layer_gemms


def modelled(gpu: GPU, s: Measured) -> float:
    """FLOP/s the planner costs one measured [m, k] x [k, n] GEMM at on ``gpu``."""
    return 2 * s.m * s.n * s.k / gemm_seconds(gpu, s.m, s.n, s.k)


def test_the_measurement_is_what_its_docstring_says():
    assert len(PUBLISHED) == 566 and len(GRID) == 165
    assert PUBLISHED[0] == Measured(32768, 6912, 2304, (801.6, 660.9))
    scatter = statistics.median(abs(a - b) / max(a, b) for a, b in (s.tflops for s in PUBLISHED))
    assert scatter == pytest.approx(0.017, abs=0.001)
    # the grid steps the output width across wave boundaries and the reduction depth from 256 to 32,768
    assert [s.n for s in GRID if s.m == 2048 and s.k == 8192][:3] == [256, 512, 768]
    assert {s.k for s in GRID if s.m == s.n == 8192} >= {256, 1024, 4096, 32768}


def test_h200_speeds_follow_the_gemms_traffic_not_tile_and_wave_quantization():
    """Over all 731 measured shapes the planner's H200 cost (FLOPs at the ceiling plus the operands' and result's
    bytes at 4.8 TB/s, unquantized) follows the measured speeds (correlation over 0.7) and misses them by less
    than a flat speed does; the A100-era tile and wave quantization on the H200's 132 SMs does not follow them
    (correlation under 0.1) and misses by more than a flat speed."""
    h200 = get_gpu("h200")
    assert not h200.tile_quantization and h200.sms == 132
    shapes = PUBLISHED + GRID
    measured = [s.flops_per_s for s in shapes]
    ours = [modelled(h200, s) for s in shapes]
    tiles = [quantization(s.m, s.n, 132) for s in shapes]
    flat = [1.0] * len(shapes)
    assert correlation(ours, measured) > 0.7 and correlation(tiles, measured) < 0.1
    assert scaled_error(ours, measured) < scaled_error(flat, measured) < scaled_error(tiles, measured)
    # the grid made to show wave quantization shows the opposite of it, and the reduction depth instead
    g_measured = [s.flops_per_s for s in GRID]
    assert correlation([modelled(h200, s) for s in GRID], g_measured) > 0.75
    assert correlation([quantization(s.m, s.n, 132) for s in GRID], g_measured) < -0.2


def test_a_shallow_reduction_runs_slower_as_measured():
    """m = n = 8,192 on the H200: at k = 512 the operands and result (151 MB, 31 µs at 4.8 TB/s) add 30% to
    the FLOPs' 106 µs at the ceiling, so the GEMM runs at 80% of the speed of a k = 32,768 one (measured: 74%);
    tile and wave quantization sees the same [8192, 8192] output either way and no difference."""
    h200 = get_gpu("h200")
    by_k = {s.k: s for s in GRID if s.m == s.n == 8192}
    assert operand_bytes([(8192, 8192, 512, 1.0)]) == 2 * (8192 * 512 * 2 + 8192 * 8192)
    ratio_model = modelled(h200, by_k[512]) / modelled(h200, by_k[32768])
    ratio_measured = by_k[512].flops_per_s / by_k[32768].flops_per_s
    assert ratio_model == pytest.approx(0.80, abs=0.01) and ratio_measured == pytest.approx(0.74, abs=0.01)


def test_the_published_runs_layers_measure_closer_to_this_model_than_to_the_one_it_replaced():
    """Each published run's layer and head GEMMs (forward, data and weight gradient) at their measured H200
    speeds: the runs' layers differ by only ±3% (a flat speed misses them by 0.8% on average), and this model
    (traffic, unquantized) misses them by less than the one before it did (tile and wave quantization on 132 SMs
    times n/(n + 40), n = min(h/t, tokens)), each after one common scale."""
    h200 = get_gpu("h200")
    speed = {(s.m, s.n, s.k): s for s in PUBLISHED}
    measured, ours, before = [], [], []
    for run in runs():
        m_, l_ = run.model, run.layout
        width = min(m_.hidden / l_.tp, l_.microbatch_size * m_.seq_len / l_.cp)
        flops = seconds = ours_s = before_s = 0.0
        for m, n, k, count in (*layer_gemms(m_, l_), head_gemm(m_, l_)):
            for shape in ((m, n, k), (m, k, n), (k, n, m)):  # forward, data gradient, weight gradient
                s = speed[tuple(int(x) for x in shape)]
                f = 2 * m * n * k * count
                flops, seconds = flops + f, seconds + f / s.flops_per_s
                ours_s += count * 2 * s.m * s.n * s.k / modelled(h200, s)
                before_s += f / (quantization(s.m, s.n, 132) * width / (width + 40))
        measured.append(flops / seconds)
        ours.append(flops / ours_s)
        before.append(flops / before_s)
    assert max(measured) / min(measured) < 1.07
    assert scaled_error([1.0] * len(measured), measured) < 0.01
    assert scaled_error(ours, measured) < 0.016 < scaled_error(before, measured)


def test_a_layers_gemms_pay_their_operands_and_results_through_hbm_in_each_pass():
    """A small MHA layer at TP 2, micro-batch 2 of 1,024 tokens (T = 2,048) on an H100 SXM: QKV [2048, 1024] x
    [1024, 1536] moves 2·(2048·1024 + 1024·1536 + 2048·1536) = 13,631,488 bytes, the projection [2048, 512] x
    [512, 1024] 7,340,032, the MLP's [2048, 1024] x [1024, 2048] and [2048, 2048] x [2048, 1024] 16,777,216 each:
    54,525,952 bytes, 16.3 µs at 3.35 TB/s, beside 25.8 GFLOP (39.6 µs at 0.658 of 989 TFLOP/s). The weight
    gradient pass is exactly those two; the head [2048, 1024] x [1024, 16000] 102,498,304 bytes."""
    m, layout = Model(4, 1024, 8, 32000, 1024), Layout(tp=2, microbatch_size=2)
    assert operand_bytes(layer_gemms(m, layout)) == 54_525_952
    assert operand_bytes([head_gemm(m, layout)]) == 102_498_304
    cluster = Cluster("h100-sxm", 2)
    gpu = cluster.gpu
    assert gemm_quantization(gpu, m, layout) == UNQUANTIZED
    assert gemm_traffic(gpu, m, layout) == pytest.approx((54_525_952 / 3.35e12, 102_498_304 / 3.35e12))
    dense = 2 * 2048 * (1024 * 1536 + 512 * 1024 + 1024 * 2048 + 2048 * 1024)
    assert dense == 25_769_803_776
    blocks = cluster.costs.blocks(m, layout, "bf16")
    assert blocks.layer.w_compute == pytest.approx(dense / (989e12 * gpu.matmul_efficiency) + 54_525_952 / 3.35e12)
    head = 2 * 2048 * 1024 * 16000 / (989e12 * gpu.matmul_efficiency)
    assert blocks.head.f_compute == pytest.approx(head + 102_498_304 / 3.35e12)
    assert blocks.head.b_compute == pytest.approx(2 * blocks.head.f_compute)


def test_only_the_a100s_are_costed_with_tile_and_wave_quantization():
    """BLOOM at TP 8, micro-batch 2: its QKV GEMM wastes part of a wave on the A100's 108 SMs; the Hopper GPUs'
    GEMMs are not quantized (their measured speeds show none)."""
    bloom, layout = Model(70, 14336, 112, 250880, 2048), Layout(tp=8, microbatch_size=2)
    (qf, _, _), _ = gemm_quantization(get_gpu("a100-80gb"), bloom, layout)
    assert qf < 0.99
    for name in ("h100-sxm", "h100-pcie", "h200"):
        assert gemm_quantization(get_gpu(name), bloom, layout) == UNQUANTIZED
