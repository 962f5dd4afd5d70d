"""The calibrated host's context-parallel attention and K/V exchange (plait.plan.host.context), by hand."""

from dataclasses import replace

import pytest

from calibrated_util import MATMUL, MIX, OVERHEAD, host_blocks, host_cluster, host_section, with_layers
from plait.context_parallel.blockwise import TILE
from plait.context_parallel.layout import causal_mask, local_positions
from plait.plan import Layout, Model
from plait.plan.host import census
from plait.plan.host import context as cp_host
from plait.plan.host.compute import in_step_costs
from plait.plan.host.figures import COLLECTIVES, Curve
from plait.plan.host.profile import Section


def _runtime_tiles(s: int, cp: int, rank: int, window: int | None) -> list[tuple[int, int, bool]]:
    """The (rows, keys, partly masked) of every tile blockwise.attend computes, read off the runtime's own mask."""
    q_pos, c = local_positions(s, cp, rank), s // 2
    found = []
    for key_rank in range(cp):
        k_pos = local_positions(s, cp, key_rank)
        for seg in (slice(0, c), slice(c, s)):
            mask = causal_mask(q_pos, k_pos[seg], window)
            for a in range(0, s, TILE):
                m = mask[a:a + TILE]
                if bool(m.any()):
                    found.append((m.shape[0], m.shape[1], not bool(m.all())))
    return sorted(found)


@pytest.mark.parametrize(("s", "cp", "window"), [(1024, 2, None), (2048, 4, None), (1536, 2, None),
                                                  (2048, 2, 300), (1024, 4, 700)])
def test_the_tiles_counted_are_the_ones_blockwise_computes(s, cp, window):
    for rank in range(cp):
        tiles, segments = cp_host.tiles(s, cp, rank, window)
        assert sorted((t.rows, t.keys, t.masked) for t in tiles) == _runtime_tiles(s, cp, rank, window)
        assert segments == 2 * cp


def test_a_cp2_rank_computes_five_tiles_two_of_them_masked():
    """s = 1024 over cp 2: rank 0 holds chunks 0 and 3 (512 tokens each, one tile); chunk 0 sees only itself
    (the diagonal, masked), chunk 3 sees chunks 0, 1, 2 whole and itself masked."""
    tiles, segments = cp_host.tiles(1024, 2, 0, None)
    assert sorted((t.rows, t.keys, t.masked) for t in tiles) == [(512, 512, False)] * 3 + [(512, 512, True)] * 2
    assert segments == 4


def test_the_attention_costs_each_tile_s_gemms_and_passes_at_the_profile_s_rates():
    sec = host_section(None)
    model = Model.preset("tiny", seq_len=2048)  # 4 heads of 32
    sh = census.local(model, Layout(microbatch_size=2, cp=2))  # s = 1024: five tiles of 512 x 512 per rank
    bh, d, e = 2 * 4, 32, 2 * 4 * 512 * 512 * 4  # batch x heads, head size, a tile's score bytes
    gemm = 2 * bh * 512 * 512 * d / MATMUL  # one of a tile's GEMMs (the flat rate)
    share = 0.4  # the element-wise mix's forward share

    def elem(traffic, ops):
        return (traffic / MIX + ops * OVERHEAD) * share

    q_tile = k_seg = bh * 512 * d * 4
    f_tile = 2 * gemm + elem(8 * e + 5 * q_tile, 5 + 2)
    b_tile = 5 * gemm + elem(9 * e + 5 * q_tile + 8 * k_seg, 5 + 5)
    masked_f, masked_b = elem(3 * e, 1), elem(3 * e, 1)
    segment = elem(8 * sh.q * 4, 9)
    f, b = cp_host.attention(sh, sec, False, None)
    assert f == pytest.approx(5 * f_tile + 2 * masked_f + 4 * segment)
    assert b == pytest.approx(5 * b_tile + 2 * masked_b)


def _curves(sec: Section) -> Section:
    curves = {(op, g): Curve((1024.0, 4e6), (1e-4 * g, 1e-4 * g + 4e6 / 1e9))
              for g in (2, 4) for op in COLLECTIVES if op != "p2p" or g == 2}
    return Section(2, 1, sec.rates, OVERHEAD, 1e10, curves)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_ring_sends_each_block_cp_minus_1_times_and_the_gradients_cp_times(cp):
    sec = _curves(host_section(None))
    sh = census.local(Model.preset("tiny", seq_len=2048), Layout(microbatch_size=2, cp=cp, cp_comm="ring"))
    kv, grads = 2 * sh.k * 2, 2 * sh.k * 4  # bf16 keys and values in one message; their fp32 gradients
    p2p = sec.collectives[("p2p", 2)]
    f, b = cp_host.exchange(sh, sec, 2)
    assert f == pytest.approx((cp - 1) * p2p(kv))
    assert b == pytest.approx((cp - 1) * p2p(kv) + cp * p2p(grads))


def test_the_all_gather_gathers_keys_and_values_and_reduce_scatters_their_gradients():
    sec = _curves(host_section(None))
    sh = census.local(Model.preset("tiny", seq_len=2048), Layout(microbatch_size=2, cp=4, cp_comm="allgather"))
    whole = 4 * sh.k * 2
    f, b = cp_host.exchange(sh, sec, 2)
    assert f == pytest.approx(2 * sec.collectives[("all_gather", 4)](whole))
    assert b == pytest.approx(2 * sec.collectives[("reduce_scatter", 4)](whole))


def test_a_cp_layer_charges_the_blockwise_core_not_sdpa_and_its_exchange():
    """The layer's compute is its work without attention plus the blockwise core; its collectives the exchange."""
    sec = _curves(host_section(None))
    cluster = host_cluster(sec)
    model = Model.preset("tiny", seq_len=2048)
    layout = Layout(microbatch_size=2, cp=2, cp_comm="ring")
    layer, _, _ = host_blocks(model, cluster, layout, precision="fp32")
    sh = census.local(model, layout)
    work = replace(census.layer_work(sh, 4), attention=0.0)
    base = in_step_costs(work, sec, False, layer=True)
    f, b = cp_host.attention(sh, sec, False, None)
    xf, xb = cp_host.exchange(sh, sec, 4)
    assert layer.f_compute == pytest.approx(base.f_compute + f)
    assert layer.b_compute == pytest.approx(base.b_compute + b)
    assert layer.f_tp == pytest.approx(xf) and layer.b_tp == pytest.approx(xb)


def test_windowed_layers_cost_the_tiles_their_window_keeps_averaged_by_their_share():
    sec = _curves(host_section(None))
    base = Model.preset("tiny", seq_len=2048)
    model = replace(base, sliding_window=300, window_layers=1)  # one of the layers windowed
    layout = Layout(microbatch_size=2, cp=2, cp_comm="ring")
    sh = census.local(model, layout)
    share = model.window_layer_share
    assert 0 < share < 1
    full, windowed = cp_host.attention(sh, sec, False, None), cp_host.attention(sh, sec, False, 300)
    assert sum(windowed) < sum(full)
    layer, _, _ = host_blocks(model, host_cluster(sec), layout, precision="fp32")
    plain, _, _ = host_blocks(base, host_cluster(sec), layout, precision="fp32")
    assert layer.f_compute - plain.f_compute == pytest.approx(share * (windowed[0] - full[0]))
    assert layer.b_compute - plain.b_compute == pytest.approx(share * (windowed[1] - full[1]))


def test_the_core_runs_at_the_level_real_layers_ran_their_kernels_in_a_step():
    """Where the profile timed whole calibration layers at 2x (alone) and 3x (shared) what the kernel figures give
    them, the CP core costs 2x / 3x its tiles' figures, as the rest of the layer does."""
    sec = with_layers(_curves(host_section((1e-4, 1e-3))), (2.0, 2.0), (3.0, 3.0))
    model, layout = Model.preset("tiny", seq_len=2048), Layout(microbatch_size=2, cp=2, cp_comm="ring")
    sh = census.local(model, layout)
    for shared, level in ((False, 2.0), (True, 3.0)):
        layer, _, _ = host_blocks(model, host_cluster(sec), layout, precision="fp32", shared=shared)
        base = in_step_costs(replace(census.layer_work(sh, 4), attention=0.0), sec, shared, layer=True)
        f, b = cp_host.attention(sh, sec, shared, None)
        assert layer.f_compute + layer.b_compute == pytest.approx(base.f_compute + base.b_compute + level * (f + b))
