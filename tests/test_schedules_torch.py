"""Cross-check with torch.distributed.pipelining: its parser, validator and comms dry run accept plait's
schedules, and a CSV written by torch's own ``_dump_csv`` reads back. Skipped if torch is missing."""

from __future__ import annotations

import types

import pytest

from plait.schedules import SCHEDULE_NAMES, Schedule, build_schedule

sched_mod = pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_order(s: Schedule):
    return {r: [sched_mod._Action.from_str(str(a)) for a in row] for r, row in enumerate(s.actions)}


def test_torch_validates_and_dry_runs_plait_schedules():
    checked = 0
    for name in SCHEDULE_NAMES:
        for p, m in ((2, 4), (3, 6), (4, 8)):
            v = 2 if name in ("interleaved-1f1b", "looped-bfs") else None
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
