"""The end of a step of an MoE model as the runtime runs it: expert gradients reduced, and under ZeRO sharded,
over the ranks holding the same experts (``ParallelContext.expert_dp_size``), the rest over dp·cp; against
hand-worked figures from the runtime's groups and the planner's own memory count."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

from plait.plan import Cluster, Layout, Model, Training, estimate
from plait.plan import step_end as se
from plait.plan.memory import max_rank_split, state_bytes

# 2 layers, h 64, MHA with 4 heads, SwiGLU f 128, vocabulary 256, 4 experts, top-2 (as tests/test_plan_experts.py):
# a GPU at tp2 holds 33,600 dense parameters and 2 layers of E/ep experts of 24,576 each (split: half of each)
MOE = Model(2, 64, 4, 256, 32, ffn_hidden=128, glu=True, n_experts=4, top_k=2)
DENSE = 33_600
EXPERT = 24_576


class Recorder:
    """A cost model that notes every collective (op, bytes, ranks, span) and prices it at the bytes a ring
    member sends, (n-1)/n of them; the optimizer step at the elements a rank owns."""

    weight_gather_bytes = 2

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, int, int | None]] = []

    def collective(self, op: str, nbytes: float, n: int, span: int | None = None) -> float:
        if n > 1:
            self.calls.append((op, nbytes, n, span))
        return nbytes * (n - 1) / n

    def optimizer_time(self, params: float, tensors: int, shards: float, optimizer: str) -> float:
        return params / shards

    def stream_time(self, nbytes: float, kernels: float) -> float:
        return nbytes


# (layout, expert parameters on a GPU, the ranks holding the same experts): whole experts over dp·tp/ep ranks,
# split ones over dp/ep (plait.distributed.context: expert_dp_size)
CASES = [
    (Layout(tp=2, dp=2, ep=1), 2 * 4 * EXPERT, 4),      # every rank of the stage holds all four experts
    (Layout(tp=2, dp=2, ep=2), 2 * 2 * EXPERT, 2),
    (Layout(tp=2, dp=2, ep=4), 2 * 1 * EXPERT, 1),      # each expert on one rank: nothing to reduce
    (Layout(tp=2, dp=2, ep=2, expert_tp=True), 2 * 2 * EXPERT // 2, 1),
    (Layout(tp=2, dp=2, ep=1, expert_tp=True), 2 * 4 * EXPERT // 2, 2),
]


@pytest.mark.parametrize("layout,expert,group", CASES)
def test_expert_gradients_go_over_the_expert_data_parallel_group(layout, expert, group):
    """ZeRO-0: an all-reduce of the dense gradients over dp = 2 and one of the experts' over their group (fp32);
    ZeRO-1/2: a reduce-scatter of each and an all-gather of its bf16 weights; every group in the stage's plane of
    4 ranks. The optimizer steps, and ZeRO keeps the state of, dense/2 + expert/group elements: the same count
    the memory model shards (12 B an element with bf16)."""
    assert max_rank_split(MOE, layout) == (DENSE, expert)
    params = DENSE + expert
    for zero in (0, 1, 2):
        lay = replace(layout, zero=zero)
        rec = Recorder()
        reduction, gather = se.dp_sync_parts(MOE, SimpleNamespace(costs=rec), lay, params, "fp32", expert)
        parts = [(DENSE, 2), (expert, group)]
        if zero == 0:
            want = [("all_reduce", 4 * e, n, 4) for e, n in parts if n > 1]
        else:
            want = [(op, b * e, n, 4) for e, n in parts if n > 1 for op, b in (("reduce_scatter", 4),
                                                                             ("all_gather", 2))]
        assert sorted(rec.calls) == sorted(want)
        assert reduction == pytest.approx(sum(4 * e * (n - 1) / n for e, n in parts))
        assert gather == (0.0 if zero == 0 else pytest.approx(sum(2 * e * (n - 1) / n for e, n in parts)))
        owned = DENSE / 2 + expert / group if zero else params
        assert se.owned(lay, params, expert) == pytest.approx(owned)
        assert se.optimizer_time(SimpleNamespace(costs=rec), lay, params, 2, expert=expert) == pytest.approx(owned)
        assert state_bytes(MOE, lay, 2, True, True)[2] == pytest.approx(12 * owned)
        if zero:
            publish = se.publish_time(SimpleNamespace(costs=rec), lay, params, 2, "bf16", expert=expert)
            assert publish == pytest.approx(8 * owned + 4 * params)


def test_zero3_gathers_and_scatters_experts_over_their_group():
    """ZeRO-3 (pp = 1): the dense parameters as one bucket per block over dp (2 layers, the embedding, the final
    norm and the head: 5), the experts as one bucket per layer over the ranks holding them (2 collectives of half
    their elements each)."""
    for layout, expert, group in CASES:
        rec = Recorder()
        lay = replace(layout, zero=3)
        gather, scatter = se.zero3_collectives(SimpleNamespace(costs=rec), lay, DENSE + expert, 5, "fp32", expert)
        want = [(op, b * e / k, n, 4) for e, n, k in ((DENSE, 2, 5), (expert, group, 2)) if n > 1
                for op, b in (("all_gather", 2), ("reduce_scatter", 4))]
        assert sorted(rec.calls) == sorted(want)  # one block's of each, priced once and counted k times
        assert scatter == pytest.approx(4 * (DENSE / 2 + expert * (group - 1) / group))
        assert gather == pytest.approx(2 * (DENSE / 2 + expert * (group - 1) / group))


def test_a_plan_exposes_only_the_dense_reduction_where_each_expert_has_one_holder():
    """Whole experts at tp2·dp2·ep4: each expert lives on one rank, so its gradient is reduced nowhere; the
    plan's exposed DP traffic (no overlap) is the dense reduce-scatter and all-gather over dp = 2 alone, at the
    H100 cluster's prices. At ep2 the experts add their own pair over 2 ranks."""
    cluster = Cluster("h100-sxm", 4)
    training = Training(8, overlap_grad_reduce=False)
    price = cluster.costs.collective

    def dense_and(expert: float, n: int) -> float:
        return sum(price(op, b * e, k, 4) for e, k in ((DENSE, 2), (expert, n))
                   for op, b in (("reduce_scatter", 4), ("all_gather", 2)))

    alone = estimate(MOE, cluster, Layout(tp=2, dp=2, ep=4, zero=1), training).time["dp_comm"]
    assert alone == pytest.approx(dense_and(0.0, 1))
    pair = estimate(MOE, cluster, Layout(tp=2, dp=2, ep=2, zero=1), training).time["dp_comm"]
    assert pair == pytest.approx(dense_and(4 * EXPERT, 2))
