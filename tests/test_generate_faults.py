"""A pipeline stage that stops answering in the middle of ``plait.generate`` ends its peer's decoding with a
CommTimeoutError naming what the peer waited for and the rank it waited on, not the backend's bare timeout."""

from __future__ import annotations

import time

import pytest

import checks_faults
from harness import PRELOAD, launch


@pytest.mark.parametrize("stuck,after,needle", [
    (1, 0, "generate: pipeline rank 0 waited more than 3s for the tokens of prompt 0 at new position 0 from "
           "global rank 1"),
    (0, 0, "generate: pipeline rank 1 waited more than 3s for the hidden states of prompt 0 at new position 0 "
           "into chunk 1 from global rank 0"),
    (1, 2, "generate: pipeline rank 0 waited more than 3s for the tokens of prompt 0 at new position 1 from "
           "global rank 1"),  # mid-decode: both prompts' first new tokens arrived
    (0, 2, "generate: pipeline rank 1 waited more than 3s for the hidden states of prompt 0 at new position 1 "
           "into chunk 1 from global rank 0"),
    # the last stage stops before taking the last hidden states: its peer's decode loop is over, and the send it
    # has in flight is what waits
    (1, 6, "generate: pipeline rank 0 waited more than 3s for the send of the hidden states of prompt 1 at new "
           "position 3 into chunk 1 to global rank 1"),
    (1, 7, "generate: pipeline rank 0 waited more than 3s for every prompt's tokens (the last stage's broadcast) "
           "from global rank 1"),
])
def test_a_stuck_stage_is_named_by_its_peer(tmp_path, stuck, after, needle):
    t0 = time.monotonic()
    world = launch(checks_faults.silent_decode_peer, 2, stuck, after, str(tmp_path / "done"), timeout_s=120,
                   preload=PRELOAD)
    waiter = world[1 - stuck]
    assert world[stuck] == {"role": "silent", "ran": after}, world[stuck]
    assert waiter["raised"] == "CommTimeoutError" and needle in waiter["message"], waiter
    assert time.monotonic() - t0 < 100, "the timeout did not fire promptly"
