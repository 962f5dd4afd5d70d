"""The shared launch's bounds (shared_world.launch_groups): a group that runs past its bound fails with the check
each rank was in, keeps the results of the checks it ended, and the groups after it still run and report."""

from __future__ import annotations

import pytest

from harness import PRELOAD, result
from shared_world import group_result, launch_groups


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    groups = {"first": ("checks_shared_world", ("plain",)), "slow": ("checks_shared_world", ("stuck",)),
              "last": ("checks_shared_world", ("plain",))}
    bounds = {"first": 60.0, "slow": 8.0, "last": 60.0}
    return launch_groups(groups, 2, bounds, str(tmp_path_factory.mktemp("notes")), preload=PRELOAD)


def test_the_groups_before_and_after_a_slow_one_report_their_results(world):
    for group in ("first", "last"):
        assert result(group_result(world, group), "sum") == [3.0, 3.0]
        assert [r["mode"] for r in group_result(world, group)] == ["plain", "plain"]


def test_a_group_past_its_bound_names_itself_and_the_check_each_rank_was_in(world):
    slow = group_result(world, "slow")
    assert result(slow, "sum") == [3.0, 3.0]  # ended before the bound: kept
    with pytest.raises(AssertionError) as info:
        result(slow, "stuck")
    message = str(info.value)
    assert "group 'slow' did not end (bound 8 s)" in message, message
    assert "rank 0: ran past its bound of 8 s in check 'stuck'" in message, message
    assert "rank 1: ran past its bound of 8 s in check 'stuck'" in message, message
    with pytest.raises(AssertionError, match="'after' was not reached: group 'slow' did not end"):
        slow[0]["after"]
    with pytest.raises(AssertionError, match="check 'after' did not run on rank 0: group 'slow' did not end"):
        result(slow, "after")
