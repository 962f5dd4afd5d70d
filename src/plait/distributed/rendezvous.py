"""A key-value store of this generation of workers alone, for the default process group under torchrun.

torchrun's c10d rendezvous hands its workers a store that the agent keeps for the whole job
(``TORCHELASTIC_USE_AGENT_STORE=True``; the same ``MASTER_PORT`` in every restart). When workers restart
(``--max-restarts``), the keys the dead generation wrote are still there: a new worker that reads a peer's
address before that peer has written its new one connects to a dead process (Gloo: ``connectFullMesh failed
... Connection refused``, the same remote port each retry; NCCL: a stale unique id). Which worker reads first
is a race, so a restart may form its groups or fail.

Here rank 0 of each generation starts a store of its own on a free port and publishes its port and a fresh
nonce under one key of the agent's store; the other ranks read that key, connect, and check the nonce in the
new store. A key left by a dead generation names a dead port (refused: read the key again) or, should the
port have been reused, a store without that nonce (read again): nothing of a dead generation is used. The
agent's store only carries the pointer; every group of the new world starts from empty keys. A port is tried
with a plain socket before a store client connects to it: a TCPStore client retries a refused port until its
timeout, logging each try with a C++ stack trace.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import uuid

import torch.distributed as dist

from plait.errors import CommTimeoutError

KEY = "plait/generation_store"  # in the agent's store: "<port> <nonce>" of the current generation's store
NONCE = "plait/nonce"  # in the generation's store
ATTEMPT_S = 2.0  # one try to connect to (and read from) a published store


def agent_store_shared() -> bool:
    """Whether this worker was started by torchrun with the agent's long-lived store as its rendezvous."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ


def generation_store(rank: int, timeout_s: float) -> dist.Store:
    """This generation's store (collective in effect: every rank of the new world calls it at start-up)."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    agent = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    if rank == 0:
        own = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        nonce = uuid.uuid4().hex
        own.set(NONCE, nonce)
        agent.set(KEY, f"{own.port} {nonce}")
        return own
    return _join(agent, host, rank, timeout_s)


def _join(agent: dist.Store, host: str, rank: int, timeout_s: float) -> dist.Store:
    """Connect to the store rank 0 published, passing over what a dead generation left."""
    deadline = time.monotonic() + timeout_s
    seen = "nothing"
    while time.monotonic() < deadline:
        try:
            published = agent.get(KEY).decode()  # waits (up to the timeout) until some generation wrote it
        except dist.DistStoreError as exc:
            raise CommTimeoutError(f"rank {rank} waited more than {timeout_s:g}s for global rank 0 to publish this "
                                   f"job's store at start-up (stopped, hung or not started?): {exc}") from exc
        port, nonce = published.split()
        seen = f"port {port}"
        if not _listening(host, int(port)):  # a dead generation's store: read the key again
            time.sleep(0.1)
            continue
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=ATTEMPT_S))
            if store.get(NONCE).decode() == nonce:
                store.set_timeout(datetime.timedelta(seconds=timeout_s))
                return store
        except (RuntimeError, OSError):  # refused (a dead generation's port) or not this store's key
            pass
        time.sleep(0.1)
    raise CommTimeoutError(f"rank {rank}: rank 0 of this generation did not publish a reachable store on {host} "
                           f"within {timeout_s:.0f}s (last seen: {seen}); did rank 0 die during the restart?")


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections on ``host:port`` (a dead process's port refuses at once)."""
    try:
        with socket.create_connection((host, port), timeout=ATTEMPT_S):
            return True
    except OSError:
        return False
