"""A restarted worker joins its generation's store past the key a dead generation left, quietly."""

from __future__ import annotations

import json
import subprocess
import sys

# One process plays torchrun's agent store (holding a dead generation's key), the new rank 0 (publishing its
# store after a while) and the new rank 1 (joining): rank 1 must pass over the dead port without a store client's
# connection attempts, each of which waits out its timeout and logs a C++ stack trace.
CODE = """
import datetime, json, os, threading, time
import torch.distributed as dist
from plait.distributed import rendezvous

agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
dead = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
agent.set(rendezvous.KEY, f"{dead.port} 0123")  # what the dead generation's rank 0 published
del dead
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(agent.port))
rank0 = []  # the new rank 0, a little late; its store serves while it lives
threading.Timer(3.0, lambda: rank0.append(rendezvous.generation_store(0, 30))).start()
t0 = time.monotonic()
store = rendezvous.generation_store(1, 30)
print(json.dumps({"joined_s": time.monotonic() - t0, "nonce": store.get(rendezvous.NONCE).decode()}))
"""


def test_a_restarted_rank_passes_over_a_dead_generations_store_without_retrying_it():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["nonce"]) == 32 and 2.9 < out["joined_s"] < 10, out  # the new generation's store, once published
    for noise in ("socket has timed out", "TCP client failed", "Exception raised from"):
        assert noise not in proc.stderr, proc.stderr[-3000:]


def test_a_rank_0_that_never_publishes_its_store_is_named_by_the_others(monkeypatch):
    """Rank 0 stopped or hung before it published this job's store: a joining rank ends after its timeout with a
    CommTimeoutError naming rank 0 and the wait, not the store's bare 'wait timeout ... keys: ...'."""
    import time

    import pytest
    import torch.distributed as dist

    from plait.distributed import rendezvous
    from plait.errors import CommTimeoutError

    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # no generation wrote its key
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"^rank 1 waited more than 1s for global rank 0 to publish this "
                                               r"job's store at start-up \(stopped, hung or not started\?\)"):
        rendezvous.generation_store(1, 1.0)
    assert time.monotonic() - t0 < 30
