"""Planted bugs must be caught by ``Schedule.validate`` with a readable, marked per-rank grid."""

from __future__ import annotations

import pytest

from plait.errors import ConfigError
from plait.schedules import Action, build_schedule


def _swap(row, a, b):
    i, j = row.index(a), row.index(b)
    row[i], row[j] = row[j], row[i]


def _message(schedule) -> str:
    with pytest.raises(ConfigError) as info:
        schedule.validate()
    return str(info.value)


def test_missing_backward_is_reported_with_its_forward_marked():
    s = build_schedule("1f1b", 4, 8)
    s.actions[2].remove(Action("B", 2, 3))
    msg = _message(s)
    assert "no backward for chunk 2 micro-batch 3" in msg
    assert "expected 2B3, or 2I3 then 2W3, on rank 2" in msg
    rank2 = next(line for line in msg.splitlines() if line.strip().startswith("rank 2 |"))
    assert "[2F3]" in rank2


def test_cross_rank_deadlock_names_the_blocked_actions():
    s = build_schedule("1f1b", 4, 8)
    _swap(s.actions[0], Action("B", 0, 0), Action("F", 0, 1))  # rank 0 waits for a backward too early
    msg = _message(s)
    assert msg.splitlines()[0].endswith("deadlock in the dry run (ranks run their lists in order; receives block):")
    assert "rank 0 step 1: [0B0] waits for the input-gradient from 1B0" in msg
    assert "rank 1 step 1: [1F1] waits for the output of 0F1, which rank 0 runs at step 4" in msg
    grid = {line.split("|")[0].strip(): line for line in msg.splitlines() if "|" in line}
    assert "[0B0]" in grid["rank 0"] and "[1F1]" in grid["rank 1"] and "[" not in grid["rank 3"].split("|")[1][:5]


def test_weight_before_its_input_gradient_deadlocks():
    s = build_schedule("zb-h1", 2, 4)
    _swap(s.actions[1], Action("I", 1, 0), Action("W", 1, 0))
    msg = _message(s)
    assert "[1W0] waits for its own 1I0, which this rank only runs later, at step 4" in msg


def test_v_shape_turnaround_order_on_the_same_rank():
    s = build_schedule("zbv", 2, 4)
    _swap(s.actions[1], Action("F", 1, 0), Action("F", 2, 0))  # chunk 2 before chunk 1 on rank 1
    msg = _message(s)
    assert "rank 1 step 0: [2F0] waits for the output of 1F0, which this rank only runs later" in msg


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda s: s.actions[0].append(Action("F", 0, 0)), "0F0 appears twice"),
        (lambda s: s.actions[1].insert(0, Action("F", 0, 0)), "0F0 is chunk 0, which lives on rank 0"),
        (lambda s: s.actions[0].append(Action("F", 0, 9)), "out of range"),
        (lambda s: s.actions[1].remove(Action("F", 1, 2)), "no forward 1F2 (expected on rank 1)"),
        (lambda s: s.actions[1].append(Action("I", 1, 0)), "1B0 and 1I0 both present"),
        (lambda s: s.actions[1].append(Action("W", 1, 0)), "1W0 without a split input-gradient step"),
    ],
)
def test_structural_errors(mutate, needle):
    s = build_schedule("1f1b", 2, 4)
    mutate(s)
    msg = _message(s)
    assert needle in msg
    assert "rank 0 |" in msg and "rank 1 |" in msg


def test_split_backward_without_weight():
    s = build_schedule("zb-h1", 2, 3)
    s.actions[0].remove(Action("W", 0, 1))
    assert "0I1 has no matching weight-gradient step 0W1" in _message(s)


def test_long_rows_are_windowed_around_the_mark():
    s = build_schedule("interleaved-1f1b", 4, 64, 4)
    s.actions[3].remove(Action("B", 7, 40))
    msg = _message(s)
    rank3 = next(line for line in msg.splitlines() if line.strip().startswith("rank 3 |"))
    assert "[7F40]" in rank3 and "more) …" in rank3 and len(rank3) < 260
