"""Simulator tests: closed-form bubbles and memory (uniform stages, free communication), costs semantics."""

from __future__ import annotations

import pytest

from plait.errors import ConfigError
from plait.schedules import Action, build_schedule
from plait.sim import Costs, simulate

UNIFORM = Costs(forward=1.0, backward=2.0)
F_EQ_I_EQ_W = Costs(forward=1.0, backward=2.0, weight=1.0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_closed_form(name):
    # (p-1)/(m+p-1), Huang et al. 2019 (GPipe) and Narayanan et al. 2021 (PipeDream-Flush / 1F1B)
    for p in range(1, 8):
        for m in (1, 2, 3, 5, 8, 13, 16):  # includes m < p
            r = simulate(build_schedule(name, p, m), UNIFORM)
            assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m)
            assert r.makespan == pytest.approx((m + p - 1) * 3.0)
            assert r.idle == pytest.approx([(p - 1) * 3.0] * p)


def test_interleaved_bubble_closed_form():
    # (p-1)/(v·m+p-1), Narayanan et al. 2021 §2.2, for m divisible by p
    for p in (2, 3, 4, 6):
        for v in (1, 2, 3, 4):
            for m in (p, 2 * p, 4 * p):
                r = simulate(build_schedule("interleaved-1f1b", p, m, v), UNIFORM)
                assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)


def test_looped_bfs_matches_interleaved_bubble_with_gpipe_memory():
    r = simulate(build_schedule("looped-bfs", 4, 8, 2), UNIFORM)
    assert r.bubble_fraction == pytest.approx(3 / (2 * 8 + 3))
    assert r.peak_activations == [8.0] * 4


def test_peak_activations_gpipe_and_1f1b():
    for p in (1, 2, 4, 6):
        for m in (1, 3, 4, 8):
            g = simulate(build_schedule("gpipe", p, m), UNIFORM)
            assert g.peak_activations[0] == m
            o = simulate(build_schedule("1f1b", p, m), UNIFORM)
            assert o.peak_activations == [min(p - r, m) for r in range(p)]
            assert o.peak_activations[0] == min(p, m)


def test_interleaved_peak_activations_closed_form():
    # p·(1 + (p-1)/(p·v)) micro-batches on rank 0 (Korthikanti et al. 2022, interleaved schedule)
    for p, v in ((2, 2), (4, 2), (4, 4), (8, 2)):
        r = simulate(build_schedule("interleaved-1f1b", p, 2 * p, v), UNIFORM)
        assert r.peak_activations[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_zb_h1_third_of_1f1b_idle_at_1f1b_memory():
    # Qi et al. 2023: bubble (p-1)(T_F+T_B) -> (p-1)(T_F+T_I-T_W) = a third when F = I = W
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            zb = simulate(build_schedule("zb-h1", p, m), F_EQ_I_EQ_W)
            base = simulate(build_schedule("1f1b", p, m), F_EQ_I_EQ_W)
            assert sum(zb.idle) / sum(base.idle) == pytest.approx(1 / 3, abs=0.02), (p, m)
            assert max(zb.peak_activations) == max(base.peak_activations) == p


def test_zbv_and_dualpipev_far_below_1f1b():
    for p in (2, 4, 8):
        m = 4 * p
        base = simulate(build_schedule("1f1b", p, m), F_EQ_I_EQ_W)
        zbv = simulate(build_schedule("zbv", p, m), F_EQ_I_EQ_W)
        dual = simulate(build_schedule("dualpipev", p, m), F_EQ_I_EQ_W)
        assert zbv.bubble_fraction < 0.25 * base.bubble_fraction, p
        assert dual.bubble_fraction < 0.5 * base.bubble_fraction, p
        assert max(zbv.peak_activations) <= p  # 1F1B's peak memory (2P chunks of 1/2)


def test_p2p_latency_and_split_costs():
    naive = simulate(build_schedule("gpipe", 2, 1), Costs(1.0, 2.0, p2p=0.25))
    assert naive.makespan == pytest.approx(1 + 0.25 + 1 + 2 + 0.25 + 2)
    zb = simulate(build_schedule("zb-h1", 2, 2), Costs(1.0, 3.0, weight=1.0))
    durations = {a.kind: t1 - t0 for _, a, t0, t1 in zb.timeline}
    assert durations == {"F": 1.0, "I": 2.0, "W": 1.0}
    default_w = simulate(build_schedule("zb-h1", 2, 2), Costs(1.0, 3.0))
    assert {a.kind: t1 - t0 for _, a, t0, t1 in default_w.timeline}["W"] == 1.5


def test_chunk_costs_and_unbalanced_stages():
    inter = simulate(build_schedule("interleaved-1f1b", 2, 2, 2), Costs(1.0, 2.0))
    assert {a.kind: t1 - t0 for _, a, t0, t1 in inter.timeline} == {"F": 0.5, "B": 1.0}
    per_rank = simulate(build_schedule("gpipe", 2, 1), Costs(forward=[1.0, 3.0], backward=[2.0, 4.0]))
    assert per_rank.makespan == pytest.approx(1 + 3 + 4 + 2)
    assert per_rank.busy == [3.0, 7.0]
    per_chunk = simulate(build_schedule("zbv", 2, 1), Costs(forward=[1, 2, 3, 4], backward=[2, 2, 2, 2]))
    f = {a.stage: t1 - t0 for _, a, t0, t1 in per_chunk.timeline if a.kind == "F"}
    assert f == {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}


@pytest.mark.parametrize(
    ("costs", "needle"),
    [
        (Costs(1.0, 2.0, weight=3.0), "weight=3.0"),
        (Costs(-1.0, 2.0), "forward=-1.0"),
        (Costs(1.0, [1.0, 2.0, 3.0]), "backward=[1.0, 2.0, 3.0]: a list of 3 times; give one per rank (2) or one per "
                                      "chunk (2)"),
        (Costs(1.0, 2.0, p2p=-0.5), "p2p=-0.5"),
        (Costs("1", 2.0), "forward='1'"),
    ],
)
def test_bad_costs(costs, needle):
    with pytest.raises(ConfigError) as info:
        simulate(build_schedule("1f1b", 2, 2), costs)
    assert needle in str(info.value)


def test_timeline_respects_order_and_dependencies():
    s = build_schedule("interleaved-1f1b", 4, 8, 2)
    r = simulate(s, Costs(1.0, 2.0, p2p=0.1))
    assert len(r.timeline) == s.num_actions
    end = {}
    last_end = [0.0] * s.num_ranks
    for rank, act, t0, t1 in r.timeline:
        assert t0 >= last_end[rank] - 1e-12 and t1 > t0
        last_end[rank] = t1
        end[act] = (rank, t1)
    for rank, act, t0, _ in r.timeline:
        if act.kind == "F" and act.stage > 0:
            src_rank, src_end = end[Action("F", act.stage - 1, act.microbatch)]
            assert t0 >= src_end + (0.1 if src_rank != rank else 0.0) - 1e-12
    assert r.makespan == pytest.approx(max(last_end))


def test_deadlocking_schedule_is_rejected_by_simulate():
    s = build_schedule("1f1b", 3, 4)
    row = s.actions[0]
    i, j = row.index(Action("B", 0, 0)), row.index(Action("F", 0, 1))
    row[i], row[j] = row[j], row[i]
    with pytest.raises(ConfigError, match=r"deadlock .*\n.*\[0B0\]"):
        simulate(s, UNIFORM)


def test_shared_cores_slow_ranks_by_the_handoff_only_while_they_outnumber_the_cores():
    """``plait.sim.shared``: k computing ranks run at ``cores / k`` of their speed, and ``handoff`` times slower
    still, but only while k > cores; with a core each, or one rank at a time, the hand-off costs nothing."""
    from plait.errors import ConfigError
    from plait.sim.shared import simulate_shared

    sched = build_schedule("gpipe", 2, 4)
    cpu = {"F": [1.0, 1.0], "B": [2.0, 2.0], "I": [0.0, 0.0], "W": [0.0, 0.0]}
    comm = {k: [0.0, 0.0] for k in "FBIW"}
    free = simulate_shared(sched, cpu, comm, 0.0, 2.0).makespan
    alone = simulate(sched, Costs(forward=1.0, backward=2.0, weight=None, p2p=0.0))
    assert free == alone.makespan
    assert simulate_shared(sched, cpu, comm, 0.0, 2.0).bubble_fraction == alone.bubble_fraction == 1 / 5
    assert simulate_shared(sched, cpu, comm, 0.0, 2.0, handoff=1.5).makespan == free  # a core each
    one = simulate_shared(sched, cpu, comm, 0.0, 1.0).makespan
    slow = simulate_shared(sched, cpu, comm, 0.0, 1.0, handoff=1.5).makespan
    # one core does all 24 s of work; with the hand-off, the part of it done two ranks at a time takes 1.5
    # times as long, the parts done alone (the first forward, the last backward) do not
    assert one == pytest.approx(24.0) and one + 1.0 < slow < 1.5 * one
    single = build_schedule("gpipe", 2, 1)  # one micro-batch: never two ranks at once
    assert simulate_shared(single, cpu, comm, 0.0, 1.0, handoff=3.0).makespan == pytest.approx(6.0)
    with pytest.raises(ConfigError, match="handoff"):
        simulate_shared(sched, cpu, comm, 0.0, 1.0, handoff=0.9)
