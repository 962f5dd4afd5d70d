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
