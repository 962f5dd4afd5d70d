"""A rank that stops answering or dies ends the step with a message naming the rank, action and peer. The worlds
fork from the server that imported torch once (harness.PRELOAD): their start-up is not what is tested."""

import time

import checks_faults
from harness import PRELOAD, launch
from plait.distributed.launch import run_world


def test_stuck_peer_is_named_not_a_hang(tmp_path):
    t0 = time.monotonic()
    world = launch(checks_faults.silent_peer, 2, "stuck", str(tmp_path / "done"), timeout_s=120, preload=PRELOAD)
    elapsed = time.monotonic() - t0
    waiter = world[0]
    assert world[1]["role"] == "silent"
    assert waiter["raised"] == "CommTimeoutError", waiter
    msg = waiter["message"]
    assert "pipeline rank 0 stuck in action 0B0" in msg, msg
    assert "gradient from global rank 1" in msg, msg
    assert "[0B0]" in msg, "the schedule grid around the stuck action is missing"
    assert elapsed < 100, "the timeout did not fire promptly"


def test_dead_peer_is_named():
    values = run_world(checks_faults.silent_peer, 2, "dead", timeout_s=120, return_failures=True,
                       allow_dead=True, preload=PRELOAD)
    waiter = values[0]
    assert waiter["raised"] in ("CommError", "CommTimeoutError"), waiter
    assert "pipeline rank 0" in waiter["message"] and "rank 1" in waiter["message"], waiter["message"]


def test_a_lowered_timeout_ends_a_collective_a_peer_never_joins(tmp_path):
    """ParallelContext.set_timeout takes effect on groups that already exist (torch's _set_pg_timeout)."""
    world = launch(checks_faults.lowered_timeout, 2, str(tmp_path / "done"), timeout_s=120, preload=PRELOAD)
    waiter = world[0]
    assert world[1]["role"] == "silent" and waiter["timeout_s"] == 2.0
    for name, seconds in waiter["waited"].items():
        assert seconds is not None and 1.5 < seconds < 20, (name, waiter)  # the 60 s it was made with: not reached
    assert set(waiter["waited"]) == {"new_group", "world"}  # the 60 s it was made with: not reached


def test_a_rank_silent_at_start_up_is_named_by_plait_init(tmp_path):
    """A rank that never joins (stopped or hung before plait.init): the others' plait.init ends after its timeout
    with a CommTimeoutError saying what it waited for, not the store's bare 'wait timeout ... keys: ...'."""
    world = launch(checks_faults.silent_at_start, 2, str(tmp_path / "done"), timeout_s=120, preload=PRELOAD)
    waiter = world[0]
    assert waiter["raised"] == "CommTimeoutError", waiter
    assert waiter["message"].startswith("rank 0 waited more than 3s for "), waiter
    assert "to join the default process group (2 ranks) at start-up" in waiter["message"], waiter
    assert waiter["s"] < 60, waiter


def test_plait_init_called_by_one_rank_only_is_named_by_plait_init(tmp_path):
    """plait.init on one rank alone, the default group made already (by a first plait.init): it ends after the
    group's timeout, naming plait.init and the rank it waited for, rather than returning and leaving the wait to
    the model's first collective."""
    world = launch(checks_faults.init_alone, 2, str(tmp_path / "done"), timeout_s=120, preload=PRELOAD)
    waiter = world[0]
    assert world[1]["role"] == "silent"
    assert waiter["raised"] == "CommTimeoutError", waiter
    assert waiter["message"].startswith("plait.init's start-up agreement (every rank of the world calls plait.init, "
                                        "with the same layout) over global ranks 0,1 timed out (is global rank 1 "
                                        "stuck or dead?)"), waiter
    assert 2 < waiter["s"] < 60, waiter


def test_ranks_asking_plait_init_for_different_layouts_are_refused_alike():
    world = launch(checks_faults.init_different_layouts, 2, timeout_s=120, preload=PRELOAD)
    for rank in world:
        assert rank["raised"] == "ConfigError", world
        assert rank["message"] == (
            "plait.init: the ranks of the world asked for different layouts (global ranks 0: tp=2, cp=1, pp=1, dp=1, "
            "ep=1, expert_tp=False; global ranks 1: tp=1, cp=1, pp=1, dp=2, ep=1, expert_tp=False); every rank calls "
            "plait.init with the same tp/cp/pp/dp/ep/expert_tp"), world
