"""A stuck (alive, not answering) serving rank: /health says "stalled" once a step waits longer than
--step-timeout, and the job ends naming the rank that did not answer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from plait.generation.decode import Sampling
from plait.models import Llama, LlamaConfig
from plait.serve.engine import Engine, Request, StepStalled
from plait.serve.kv import BlockAllocator
from plait.serve.metrics import Metrics
from plait.serve.runner import Runner
from plait.serve.sampling import Params
from plait.serve.scheduler import Scheduler
from plait.serve.server import Api
from plait.tokenizers import ByteTokenizer
from serve_util import Server, tiny_model, workers

pytestmark = pytest.mark.timeout(240)
LIMIT_S = 2.0  # the no-process test's step limit: a health call this long after the step began says stalled


class _Stuck(Runner):
    """A runner whose steps with rows wait until ``release`` is set, then fail as a timed-out collective would."""

    release = threading.Event()

    def execute(self, step):
        if step.rows:
            self.release.wait(30)
            raise RuntimeError("Timed out waiting 1000ms for send operation to complete")
        return super().execute(step)


def _health(engine: Engine) -> tuple[int, dict]:
    import json

    resp = asyncio.run(Api.health(SimpleNamespace(engine=engine)))  # type: ignore[arg-type]
    return resp.status_code, json.loads(resp.body)


def test_health_says_stalled_and_the_engine_names_the_stopped_rank():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32)).eval()
    engine = Engine(_Stuck(model, 8, 4), Scheduler(BlockAllocator(8, 4), max_batch=2), ByteTokenizer(), Metrics(),
                    distributed=False)
    stopped = subprocess.Popen(["sleep", "60"])
    os.kill(stopped.pid, signal.SIGSTOP)
    engine.step_limit, engine.peers = LIMIT_S, {1: stopped.pid, 2: os.getpid()}
    events: list[dict] = []
    failure: list[BaseException] = []

    def run():
        try:
            engine.run()
        except BaseException as exc:
            failure.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    try:
        thread.start()
        assert engine.ready.wait(30)
        engine.submit(Request([1, 2, 3], Params(Sampling(4)), events.append))
        while not engine.step_began:
            time.sleep(0.01)
        assert _health(engine) == (200, {"status": "ok"})  # a step shorter than the limit is no stall
        time.sleep(LIMIT_S + 0.1)
        status, body = _health(engine)
        assert status == 503 and body["status"] == "stalled" and body["waiting_on"] == "forward (its collectives)"
        assert body["ranks"] == {"1": f"pid {stopped.pid}, stopped", "2": f"pid {os.getpid()}, running"}, body
        assert body["step_timeout"] == LIMIT_S and body["seconds"] >= LIMIT_S
        # the stopped rank alone is named: the other one runs (it may be the one waiting for it)
        assert f"rank 1 (pid {stopped.pid}, stopped) did not answer" in body["reason"], body
        assert "rank 2" not in body["reason"]
        _Stuck.release.set()
        thread.join(10)
        assert isinstance(failure[0], StepStalled) and "rank 1 (pid" in str(failure[0]), failure
        assert "Timed out waiting" in str(failure[0])  # the collective's own error follows
        assert events[-1]["type"] == "error" and "rank 1 (pid" in events[-1]["message"], events
    finally:
        _Stuck.release.set()
        stopped.kill()
        stopped.wait()


def _health_of(url: str) -> tuple[int, dict] | None:
    try:
        r = httpx.get(f"{url}/health", timeout=2)
        return r.status_code, r.json()
    except (httpx.HTTPError, ValueError):
        return None


def test_a_stopped_tp_worker_makes_health_stalled_and_ends_the_job_naming_it(tmp_path):
    server = Server(tiny_model(tmp_path / "tiny"), tmp_path, "--tp", "2", "--step-timeout", "3")
    procs: list[int] = []
    try:
        server.wait_healthy(timeout=90)
        procs = workers(server.proc.pid)
        assert len(procs) == 2, procs
        victim = procs[-1]
        os.kill(victim, signal.SIGSTOP)
        got: list = []
        client = threading.Thread(target=lambda: got.append(httpx.post(
            f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4}, timeout=60)))
        asked = time.monotonic()
        client.start()
        seen = [_health_of(server.url)]  # None: no answer within 2 s (a loaded host), asked again
        while time.monotonic() < asked + 60 and (seen[-1] is None or seen[-1][0] == 200):
            time.sleep(0.1)
            seen.append(_health_of(server.url))
        health = seen[-1]
        assert health is not None and health[0] == 503, (seen, server.output())
        # said as soon as the step had waited past --step-timeout 3: the step's own clock, which the time the
        # request took to reach a step on a loaded host does not move
        assert health[1]["status"] == "stalled" and 3 <= health[1]["seconds"] < 3 + 5, (seen, server.output())
        assert health[1]["ranks"] == {"1": f"pid {victim}, stopped"}, health
        client.join(60)
        assert got and got[0].status_code == 500, server.output()
        message = got[0].json()["error"]["message"]
        assert f"rank 1 (pid {victim}, stopped) did not answer" in message and "--step-timeout 3" in message, message
    finally:
        for pid in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        server.kill()


def test_a_follower_whose_collective_times_out_says_what_it_waited_on(monkeypatch):
    """A follower's timeout is a CommTimeoutError (the launcher reports rank 0's StepStalled before it)."""
    import torch.distributed as dist

    from plait.errors import CommTimeoutError
    from plait.serve import engine

    def timed_out(box, src):
        raise RuntimeError("Timed out waiting 8000ms for recv operation to complete")
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "broadcast_object_list", timed_out)
    with pytest.raises(CommTimeoutError, match="timed out waiting for rank 0's next step: a rank did not answer"):
        engine.follow(None)  # type: ignore[arg-type]

    def closed(box, src):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:26505. GLHF!")
    monkeypatch.setattr(dist, "broadcast_object_list", closed)
    with pytest.raises(RuntimeError) as info:
        engine.follow(None)  # type: ignore[arg-type]
    assert not isinstance(info.value, CommTimeoutError)  # a dead peer is the launcher's to name
    assert str(info.value) == ("broadcast of the next step from rank 0 over global ranks 0,1 failed (did global "
                               "rank 0 die?): Connection closed by peer [127.0.0.1]:26505")


def test_a_peer_dead_at_a_serving_collective_is_named_with_it_not_in_gloos_words(monkeypatch):
    """Rank 0's broadcast of a step, its receipt of the last stage's outputs, the start's all-gather of the ranks'
    pids and the TP all-reduces of a step's logprobs: a peer gone there is said in plait's words (what, over which
    ranks, whom it lost)."""
    import torch.distributed as dist

    from plait.errors import CommError
    from plait.serve import job, sampling

    def closed(*args, **kwargs):
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:26505. GLHF!")
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    for name in ("broadcast_object_list", "recv_object_list", "all_reduce"):
        monkeypatch.setattr(dist, name, closed)
    with pytest.raises(CommError, match=r"^broadcast of the next step from rank 0 over global ranks 0,1 failed "
                                        r"\(did global rank 1 die\?\): Connection closed by peer \[127.0.0.1\]:26505$"):
        Engine._broadcast(SimpleNamespace(distributed=True), object())  # type: ignore[arg-type]
    runner = SimpleNamespace(seqs={}, last=0, mine=(), ctx=SimpleNamespace(rank=0, timeout_s=3.0), src=1,
                             groups=lambda rows: [], _pipeline=lambda rows, groups: None)
    step = SimpleNamespace(free=[], new=[], rows=[object()])
    with pytest.raises(CommError, match=r"^serve: rank 0: the step's outputs from global rank 1 failed \(did that "):
        Runner.execute(runner, step)  # type: ignore[arg-type]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", closed)
    with pytest.raises(CommError, match=r"^all-gather of the ranks' pids over global ranks 0,1 failed "):
        job._step_limit(None, 3.0, 10.0)
    with pytest.raises(CommError, match=r"^tp all-reduce of the logits' maximum \(logprobs\) over global ranks 0,1 "):
        sampling.logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), 2, object(), 8)
    calls: list = []  # the maximum's all-reduce works, the sums' fails
    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: calls.append(1) if not calls else closed())
    with pytest.raises(CommError, match=r"^tp all-reduce of the softmax sums \(logprobs\) over global ranks 0,1 "):
        sampling.logprobs(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), 2, object(), 8)
