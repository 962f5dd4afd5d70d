"""Cross-check with torch.distributed.pipelining: its parser, validator and comms dry run accept plait's
schedules, and a CSV written by torch's own ``_dump_csv`` reads back. Skipped if torch is missing."""

from __future__ import annotations

import types

import pytest

from plait.schedules import SCHEDULE_NAMES, Schedule, build_schedule
from plait.sim import Costs, simulate

sched_mod = pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_order(s: Schedule):
    return {r: [sched_mod._Action.from_str(str(a)) for a in row] for r, row in enumerate(s.actions)}


def test_torch_validates_and_dry_runs_plait_schedules():
    checked = 0
    for name in SCHEDULE_NAMES:
        for p, m in ((2, 4), (3, 6), (4, 8)):
            v = 2 if name in ("interleaved-1f1b", "looped-bfs", "zb-h1") else None
            s = build_schedule(name, p, m, v)
            order = _torch_order(s)
            mapping = sched_mod._validate_schedule(order, p, s.num_stages, m)
            assert mapping == {c: s.stage_to_rank(c) for c in range(s.num_stages)}
            comms = sched_mod._add_send_recv(order, s.stage_to_rank, s.num_stages)
            sched_mod._simulate_comms_compute(comms, s.stage_to_rank, s.num_stages)
            checked += 1
    assert checked == 3 * len(SCHEDULE_NAMES)


def test_csv_written_by_torch_dump_csv_round_trips(tmp_path):
    s = build_schedule("interleaved-1f1b", 4, 8, 2)
    order = _torch_order(s)
    order[1] = [None, *order[1]]  # torch pads with idle steps
    path = tmp_path / "torch.csv"
    sched_mod.PipelineScheduleMulti._dump_csv(types.SimpleNamespace(pipeline_order=order), path)
    back = Schedule.from_csv(path)
    assert back.actions == s.actions and back.placement == s.placement
    # and torch parses plait's export
    text = s.to_csv()
    parsed = [[sched_mod._Action.from_str(c) for c in line.split(",")] for line in text.splitlines()]
    assert [[str(a) for a in row] for row in parsed] == [[str(a) for a in row] for row in s.actions]


def _torch_pipeline_order(cls, p: int, m: int, v: int) -> dict:
    """torch's own ``pipeline_order`` for P ranks x V stages (None = idle), built without a process group
    by calling the schedule's per-rank generator on a bare instance."""
    obj = object.__new__(cls)
    obj.pp_group_size, obj.n_local_stages, obj._n_microbatches = p, v, m
    obj.number_of_rounds = max(1, m // p)
    obj.microbatches_per_round = m // obj.number_of_rounds
    assert m % obj.number_of_rounds == 0, "torch refuses this size"
    obj.pipeline_order = {r: obj._calculate_single_rank_operations(r) for r in range(p)}
    if cls is sched_mod.ScheduleInterleavedZeroBubble:
        obj.pipeline_order = obj._add_bubbles_to_actions(p * v)
    return obj.pipeline_order


TORCH_ROUNDS = {"interleaved-1f1b": sched_mod.ScheduleInterleaved1F1B, "zb-h1": sched_mod.ScheduleInterleavedZeroBubble}


@pytest.mark.parametrize("name", list(TORCH_ROUNDS))
def test_depth_first_schedules_equal_torch_action_for_action(name):
    """Every size torch accepts (M divisible by floor(M/P)), M % P != 0 included: plait's equal rounds
    are torch's order."""
    sizes = [(p, m, v) for p in range(2, 7) for m in range(1, 3 * p + 2) for v in (2, 3)
             if m % max(1, m // p) == 0]
    assert sum(m % p != 0 and m > p for p, m, _ in sizes) > 20
    for p, m, v in sizes:
        order = _torch_pipeline_order(TORCH_ROUNDS[name], p, m, v)
        theirs = [[str(a) for a in order[r] if a is not None] for r in range(p)]
        ours = build_schedule(name, p, m, v)
        assert [[str(a) for a in row] for row in ours.actions] == theirs, (name, p, m, v)


@pytest.mark.parametrize("name, p, m, v", [("interleaved-1f1b", 4, 10, 2), ("interleaved-1f1b", 8, 18, 3),
                                           ("interleaved-1f1b", 8, 15, 2), ("zb-h1", 4, 8, 2),
                                           ("zb-h1", 4, 10, 2), ("zb-h1", 8, 18, 3)])
def test_torch_csv_loads_and_simulates_to_plaits_makespan(tmp_path, name, p, m, v):
    order = _torch_pipeline_order(TORCH_ROUNDS[name], p, m, v)
    path = tmp_path / f"{name}.csv"
    sched_mod.PipelineScheduleMulti._dump_csv(types.SimpleNamespace(pipeline_order=order), path)
    theirs = Schedule.from_csv(path)  # validates
    ours = build_schedule(name, p, m, v)
    costs = Costs(forward=1.0, backward=2.0)
    assert simulate(theirs, costs).makespan == pytest.approx(simulate(ours, costs).makespan)
    if name == "interleaved-1f1b":  # the closed form (P-1)/(V·M+P-1), which padded rounds miss
        assert simulate(theirs, costs).bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    if (name, p, m) == ("zb-h1", 4, 8):  # torch's ZB1P reaches ZB-V's makespan here
        assert simulate(theirs, costs).makespan == simulate(build_schedule("zbv", 4, 8), costs).makespan
