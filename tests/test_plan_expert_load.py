"""Uneven routing in an MoE layer's step time: under expert parallelism every EP rank waits for the busiest one,
whose experts take ``plan.experts.received`` times balanced routing's rows (``Model.expert_capacity``). Its expert
GEMMs, its SwiGLU and the all-to-all rows it receives and sends back cost that many times more, on the GPU model
and on a calibrated host; nothing else does, and a dense model or a layout without EP does not change."""

from dataclasses import replace

import pytest

from plait.plan import Cluster, Layout, Model, Training, estimate
from plait.plan import experts as ex
from plait.plan.catalogue import LINK_EFFICIENCY
from plait.plan.gemm import gemm_speed
from profile_util import synthetic_profile

MIXTRAL = Model.preset("mixtral-8x7b")
H100 = Cluster("h100-sxm", 64)  # H100s: GEMMs not costed quantized, so a GEMM's time is linear in its rows
LAYOUT = Layout(tp=1, pp=4, dp=16, ep=8, microbatch_size=1, recompute="selective")  # EP inside a node (NVLink)
FIELDS = ("f_compute", "b_compute", "w_compute", "f_tp", "b_tp", "recompute")


def layer(model: Model, layout: Layout, elementwise: str = "plait-eager"):
    return H100.costs.blocks(model, layout, "bf16", elementwise=elementwise).layer


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_the_busiest_gpu_s_expert_work_is_charged_in_a_layer(recompute):
    """Mixtral at ep8, one 4,096-token micro-batch, c = 1.25: its GPU's one expert takes 1.25 × 8,192 rows. By hand,
    the extra 2,048 rows cost: forward their FLOPs X = 2·2,048·(3·h·f)/speed, their GEMM operands (2 bytes an
    element: 2,048 rows of h + 2f and of f + h, read or written once a pass) and SwiGLU's kernels (silu 2, mul 3
    element sizes a row of f forward; backward the two muls' 6 and silu_backward's 3); backward twice the FLOPs and
    operands; the W pass once; the all-to-alls, dispatch and combine each way, a quarter more bytes over NVLink.
    Full recomputation repeats the forward and its all-to-alls; selective recomputation, the attention core only."""
    lay = replace(LAYOUT, recompute=recompute)
    h, f, gpu = MIXTRAL.hidden, MIXTRAL.ffn, H100.gpu
    base, more = layer(MIXTRAL, lay), layer(replace(MIXTRAL, expert_capacity=1.25), lay)
    rows = 0.25 * 4096 * 2  # T·top_k·ep/E balanced: 8,192
    flops = 2 * rows * 3 * h * f / gemm_speed(gpu)
    operands = 2 * rows * ((h + 2 * f) + (f + h)) / gpu.memory_bandwidth
    glu_f, glu_b = (n * 2 * rows * f / gpu.memory_bandwidth for n in (5, 9))
    a2a = 2 * 0.25 * 4096 * h * 2 * 2 * 7 / 8 / (H100.link(8).bandwidth * LINK_EFFICIENCY)  # 2 × rows × h × bf16
    want = {"f_compute": flops + operands + glu_f, "b_compute": 2 * flops + 2 * operands + glu_b,
            "w_compute": flops + operands, "f_tp": a2a, "b_tp": a2a,
            "recompute": flops + operands + glu_f + a2a if recompute == "full" else 0.0}
    for name in FIELDS:
        assert getattr(more, name) - getattr(base, name) == pytest.approx(want[name], rel=1e-9, abs=1e-15), name
    assert more.f_compute > 1.15 * base.f_compute  # the experts are most of Mixtral's layer


def test_balanced_routing_dense_models_and_layouts_without_ep_cost_as_before():
    """c = 1 adds nothing (to the bit); without EP a GPU's experts take every row its tokens route whatever the
    routing, and a dense model has no experts: c changes neither."""
    assert ex.excess_flops(MIXTRAL, LAYOUT, 4096.0) == 0.0
    assert ex.excess_flops(replace(MIXTRAL, expert_capacity=2.0), LAYOUT, 4096.0) == 2 * 4096 * 2 * MIXTRAL.mlp_params()
    two = replace(MIXTRAL, expert_capacity=2.0)
    for lay in (replace(LAYOUT, ep=1), Layout(tp=2, pp=4, dp=8, expert_tp=True, microbatch_size=1)):
        assert layer(two, lay) == layer(MIXTRAL, lay)
    dense = Model.preset("llama3-8b")
    lay = Layout(tp=2, dp=32, microbatch_size=1)
    assert layer(replace(dense, expert_capacity=2.0), lay) == layer(dense, lay)


def test_a_mixtral_step_costs_more_on_its_busiest_gpu():
    """Mixtral on 64 H100s at the c = 1 best's layout (tp1 pp4 dp16 ep8 v2 zbv, ZeRO-1): its step at c = 1.25 and 2
    grows by what a pipeline rank's 8 layers add over its 64 micro-batches (forward, backward and their
    all-to-alls), within 2% (the schedule's bubble grows with them); the model FLOPs an MFU counts stay the same,
    so the MFU falls."""
    lay = Layout(tp=1, pp=4, dp=16, ep=8, virtual_stages=2, microbatch_size=1, recompute="selective", zero=1,
                 schedule="zbv")
    training = Training(1024, elementwise="plait-eager")
    steps = {c: estimate(replace(MIXTRAL, expert_capacity=c), H100, lay, training) for c in (1.0, 1.25, 2.0)}
    per_layer = {c: layer(replace(MIXTRAL, expert_capacity=c), lay) for c in steps}
    for c in (1.25, 2.0):
        extra = sum(getattr(per_layer[c], n) - getattr(per_layer[1.0], n) for n in FIELDS[:2] + FIELDS[3:5])
        assert 0.999 <= (steps[c].step_time_s - steps[1.0].step_time_s) / (64 * 8 * extra) <= 1.02
        assert steps[c].mfu < steps[1.0].mfu
    assert steps[1.0].step_time_s < steps[1.25].step_time_s < steps[2.0].step_time_s


def test_a_calibrated_host_charges_the_busiest_rank_too():
    """plait's eager layer on a calibrated host (``plan.host``): at c = 1.5 the all-to-alls' rows cost as the
    measured curve says for 1.5 times the bytes, the counts' exchange (E int64) the same; the layer's compute
    grows (its expert GEMMs and SwiGLU: tests/test_plan_experts.py)."""
    moe = Model(2, 64, 4, 256, 32, ffn_hidden=128, glu=True, n_experts=4, top_k=2)
    lay = Layout(tp=2, dp=2, ep=2, microbatch_size=2)
    more = replace(moe, expert_capacity=1.5)
    four = Cluster.from_profile(synthetic_profile(counts=(4,)), 4)
    sec = four.costs.section
    act = 2 * 32 * 64 * 4  # [2, 32, 64] fp32; a TP rank dispatches its half of the tokens, twice (top-2)
    base, heavy = (four.costs.blocks(m, lay, "fp32").layer for m in (moe, more))
    rows = [2 * sec.collective("all_to_all", 2, c * act) for c in (1.0, 1.5)]
    assert heavy.b_tp - base.b_tp == pytest.approx(rows[1] - rows[0])
    assert heavy.f_tp - base.f_tp == pytest.approx(rows[1] - rows[0])
    assert heavy.f_compute > base.f_compute and heavy.b_compute > base.b_compute
