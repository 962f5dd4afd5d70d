"""Full recomputation on a calibrated host as plait's runtime runs it (torch's non-reentrant checkpoint stops before
a dense layer's last GEMM and its TP reduction): the host model charges the layer's forward less that GEMM's share
by the host's own figures, and less the collective after it (``HostCosts._not_recomputed``)."""

from __future__ import annotations

import pytest

from calibrated_util import MATMUL, host_cluster, host_section, tp_cluster, with_layers
from plait.plan import Layout, Model, Training
from plait.plan.host import census
from plait.plan.host.compute import work_costs
from plait.plan.timing import layer_blocks

DENSE = Model(2, 64, 4, 512, 32, 96, 2, glu=True)
MOE = Model(2, 64, 4, 512, 32, 96, 2, glu=True, n_experts=4, top_k=2)
TOKENS = 2 * 32  # two sequences of 32


def charged(cluster, model, layout, early_stop):
    return layer_blocks(cluster.costs, model, layout, Training(8, recompute_early_stop=early_stop)).layer


def down_projection_share(model, layout, sec):
    """The MLP's second GEMM, [T, f/t] x [f/t, h] at the flat matmul rate, over the layer's forward by the same
    kernel figures."""
    sh = census.local(model, layout)
    forward = work_costs(census.layer_work(sh, 2), sec, False, layer=True).f_compute
    return 2 * TOKENS * model.hidden * model.ffn / layout.tp / MATMUL / forward


@pytest.mark.parametrize("measured", [False, True])
def test_a_dense_layer_recomputes_its_forward_less_its_last_gemm(measured):
    """``measured``: whole calibration layers set the forward's level in a step (1.5-2x the kernel figures) and
    its split with the backward; the share the GEMM takes of the forward is the kernel figures'."""
    sec = host_section(None)
    if measured:
        sec = with_layers(host_section((2e-4, 3e-3)), (1.5, 2.0), (1.5, 2.0))
    layout = Layout(microbatch_size=2, recompute="full")
    early, whole = (charged(host_cluster(sec), DENSE, layout, e) for e in (True, False))
    assert whole.recompute == pytest.approx(whole.f_compute)
    share = down_projection_share(DENSE, layout, sec)
    assert 0.05 < share < 0.5
    assert early.recompute == pytest.approx(early.f_compute * (1 - share), rel=1e-12)
    assert early.f_compute == whole.f_compute and early.b_compute == whole.b_compute


@pytest.mark.parametrize("sp", [False, True])
def test_a_tp_layer_recomputes_without_the_reduction_after_its_last_gemm(sp):
    """At tp2 the forward's TP collectives are two all-reduces (SP: two gathers and two reduce-scatters), each with
    its measured wait; the recomputation skips the one after the down projection."""
    wait = 2e-4
    cluster = tp_cluster({(2, sp): wait}, p=2)
    layout = Layout(tp=2, microbatch_size=2, recompute="full", sequence_parallel=sp)
    early, whole = (charged(cluster, DENSE, layout, e) for e in (True, False))
    n_bytes = census.local(DENSE, layout).n * 2
    reduction = cluster.costs.collective("reduce_scatter" if sp else "all_reduce", n_bytes, 2) + wait
    assert whole.recompute == pytest.approx(whole.f_compute + whole.f_tp)
    share = down_projection_share(DENSE, layout, cluster.costs.section)
    assert early.recompute == pytest.approx(early.f_compute * (1 - share) + early.f_tp - reduction, rel=1e-12)
    assert reduction > 0 and early.f_tp == whole.f_tp


def test_an_moe_layer_and_other_recomputations_are_unchanged():
    """An MoE layer's router weighting saves its experts' outputs: its forward runs whole again. Selective and no
    recomputation do not depend on the flag."""
    cluster = host_cluster(host_section(None))
    full = Layout(microbatch_size=2, recompute="full")
    early, whole = (charged(cluster, MOE, full, e) for e in (True, False))
    assert early.recompute == whole.recompute == pytest.approx(whole.f_compute)
    for recompute in ("selective", "none"):
        layout = Layout(microbatch_size=2, recompute=recompute)
        assert charged(cluster, DENSE, layout, True) == charged(cluster, DENSE, layout, False)
