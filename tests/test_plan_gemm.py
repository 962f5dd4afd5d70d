"""GEMM efficiency by shape (plan.gemm): cuBLAS's tile and wave quantization, worked by hand on small cases, and
the layer's GEMMs in the GPU cost model taking it per pass."""

from dataclasses import replace

import pytest

from plait.plan import Cluster, Layout, Model
from plait.plan.gemm import passes, quantization, utilisation
from plait.plan.gpu import gemm_quantization, gemm_speed
from plait.plan.timing import layer_forward_flops, layer_gemms


def test_one_tile_more_than_a_wave_costs_a_second_wave():
    """An [m, n] output of 108 tiles of 256x128 fills the A100's 108 SMs once; one tile more (109) runs a second
    wave with one SM busy: 109 tiles' work in 216 tiles' time. The other orientation (128x256) cuts 27,904 x 128
    into 218 half-empty tiles, 3 waves: worse, so not picked."""
    assert quantization(256 * 108, 128, 108) == pytest.approx(1.0)
    assert utilisation(256 * 109, 128, 108, (128, 256)) == pytest.approx(109 / (3 * 108))
    assert quantization(256 * 109, 128, 108) == pytest.approx(109 / 216)
    # a tile overhanging the matrix costs a whole tile: 2,048 x 1,600 is 8 x 12.5 tiles of 256x128, 104 of them,
    # one wave (tile quantization alone)
    assert quantization(2048, 1600, 108) == pytest.approx(2048 * 1600 / (108 * 256 * 128))
    # 2,048 x 512: 32 tiles of 256x128 or 128x256, 64 of 128x128, 256x64 or 64x256, none filling the 108 SMs;
    # 128x64 and 64x128 give 128 tiles: that group, 2 waves, 128 tiles' work in 216 tiles' time
    assert quantization(2048, 512, 108) == pytest.approx(128 / 216)
    assert quantization(2048, 512, 0) == 1.0  # a GPU without an SM count: unquantized


def test_bloom_tp8_micro_batch_two_wastes_a_wave_where_four_does_not():
    """BLOOM 176B (hidden 14,336, 112 heads, seq 2,048) at TP 8: the fused QKV GEMM's output is [T, 5,376], 42
    columns of 128. Micro-batch 2 (T = 4,096, 16 rows of 256): 672 tiles, 6.2 waves of 108 run as 7 (672/756);
    micro-batch 4: 1,344 tiles, 13 waves (1,344/1,404)."""
    m = Model(70, 14336, 112, 250880, 2048)
    # grouped-query attention narrows the fused QKV: Llama 3 70B's 64 query and 8 KV heads of 128 at TP 8 are
    # (8 + 2) x 128 = 1,280 wide; at TP 16 each rank keeps one KV head (replicated): (4 + 2) x 128 = 768
    llama = Model(80, 8192, 64, 128256, 8192, 28672, 8, glu=True)
    assert layer_gemms(llama, Layout(tp=8))[0][1] == 1280 and layer_gemms(llama, Layout(tp=16))[0][1] == 768
    assert layer_gemms(llama, Layout(tp=8))[2][1] == 2 * 28672 / 8  # gate and up, one GEMM
    for mbs, share in ((2, 672 / 756), (4, 1344 / 1404)):
        qkv = layer_gemms(m, Layout(tp=8, microbatch_size=mbs))[0]
        assert qkv == (2048 * mbs, 3 * 14336 / 8, 14336, 1.0)
        assert quantization(qkv[0], qkv[1], 108) == pytest.approx(share)


def test_backward_passes_quantize_their_own_output_shapes():
    """A [T, K] x [K, N] forward has its data gradient [T, N] x [N, K] (output [T, K]) and its weight gradient
    [K, T] x [T, N] (output [K, N]): T = 27,904 rows of 256 with N = 128 (109 tiles, 2 waves) forward; K = 256·108
    makes the data gradient's output exactly 108 x 108 tiles and the weight gradient's 108 x 1."""
    f, d, w = passes([(256 * 109, 128, 256 * 108, 1.0)], 108)
    assert f == pytest.approx(109 / 216)
    assert d == pytest.approx(quantization(256 * 109, 256 * 108, 108))
    assert w == pytest.approx(1.0)


def test_the_layer_pays_each_passes_quantization_on_its_dense_flops():
    """The layer's forward GEMM time is its dense FLOPs at the ceiling over the forward's quantization; its
    backward the same FLOPs over the data- and the weight-gradient's: compared with the same A100 costed without
    quantization on a GQA, GLU, MoE model."""
    m = Model(4, 4096, 32, 32000, 2048, ffn_hidden=14336, n_kv_heads=8, glu=True, n_experts=8, top_k=2)
    layout = Layout(tp=4, ep=2, dp=2, expert_tp=True, microbatch_size=1, sequence_parallel=True)
    quantized = Cluster("a100-80gb", 8)
    plain = Cluster(replace(quantized.gpu, tile_quantization=False), 8)
    (qf, qd, qw), (hf, hd, hw) = gemm_quantization(quantized.gpu, m, layout)
    assert 0.5 < min(qf, qd, qw, hf, hd, hw) and max(qf, qd, qw) < 1.0  # this case is quantized
    gpu, tokens = quantized.gpu, 2048
    dense = (layer_forward_flops(m, tokens, 2048) - 4 * tokens * 2048 * 4096) / 4 / gemm_speed(gpu)
    a, b = (c.costs.blocks(m, layout, "bf16") for c in (quantized, plain))
    assert a.layer.f_compute - b.layer.f_compute == pytest.approx(dense * (1 / qf - 1))
    assert a.layer.b_compute - b.layer.b_compute == pytest.approx(dense * (1 / qd + 1 / qw - 2))
    assert a.layer.w_compute - b.layer.w_compute == pytest.approx(dense * (1 / qw - 1))
    head = 2 * tokens * 4096 * 32000 / 4 / gemm_speed(gpu)  # its GEMM's traffic is the same either way
    assert a.head.f_compute - b.head.f_compute == pytest.approx(head * (1 / hf - 1))
    # each expert's GEMMs run on its tokens: 2,048 x top-2 x ep 2 / 8 experts = 1,024, 4 experts on each rank,
    # each split over TP; whole experts run on the rank's quarter of the tokens, at full width
    up = layer_gemms(m, layout)[2]
    assert up == (1024, 2 * 14336 / 4, 4096, 4.0)
    assert layer_gemms(m, replace(layout, expert_tp=False))[2:] == ((256, 2 * 14336, 4096, 4.0),
                                                                    (256, 4096, 14336, 4.0))
