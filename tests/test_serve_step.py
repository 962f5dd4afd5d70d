"""A serving step's hand-over to the HTTP side: a step's events wake the event loop about once, not once a token."""

from __future__ import annotations

import asyncio
import threading

import httpx
import torch

from plait.models import Llama, LlamaConfig
from plait.serve.engine import Engine
from plait.serve.kv import BlockAllocator
from plait.serve.metrics import Metrics
from plait.serve.protocol import Limits
from plait.serve.runner import Runner
from plait.serve.scheduler import Scheduler
from plait.serve.server import Api
from plait.serve.tokens import TokenizerInfo
from plait.tokenizers import ByteTokenizer

TOK = ByteTokenizer()


def _serve(n: int, new: int, stream: bool = False) -> tuple[list[httpx.Response], dict[str, int]]:
    """``n`` concurrent completions of ``new`` tokens through the HTTP routes (in this process) and a live engine;
    the responses and counts: engine steps, cross-thread wake-ups of the loop, callbacks the loop scheduled."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96)).eval()
    runner = Runner(model, num_blocks=64, block_size=4)
    counts = {"steps": 0, "wakeups": 0, "callbacks": 0}
    execute = runner.execute

    def counted(step):
        counts["steps"] += bool(step.rows)
        return execute(step)

    runner.execute = counted  # type: ignore[method-assign]
    engine = Engine(runner, Scheduler(BlockAllocator(64, 4), max_batch=n), TOK, Metrics(), distributed=False)
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    api = Api(engine, Limits("m", 96, 256, 32, 256), TokenizerInfo(TOK, "/nonexistent", 96), Metrics(), max_queue=64)

    async def main() -> list[httpx.Response]:
        loop = asyncio.get_running_loop()
        threadsafe, soon = loop.call_soon_threadsafe, loop.call_soon

        def count_wakeup(*args, **kwargs):
            counts["wakeups"] += 1
            return threadsafe(*args, **kwargs)

        def count_callback(*args, **kwargs):
            counts["callbacks"] += 1
            return soon(*args, **kwargs)

        loop.call_soon_threadsafe, loop.call_soon = count_wakeup, count_callback  # type: ignore[method-assign]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app()), base_url="http://plait") as c:
            body = {"model": "m", "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": stream}
            return await asyncio.gather(*[c.post("/v1/completions", json={**body, "prompt": f"prompt {i}"})
                                          for i in range(n)])

    try:
        assert engine.ready.wait(30)
        responses = asyncio.run(main())
    finally:
        engine.stopping.set()
        thread.join(10)
    assert all(r.status_code == 200 for r in responses)
    return responses, counts


def test_a_steps_events_wake_the_http_loop_about_once_not_once_a_token():
    n, new = 8, 16
    responses, counts = _serve(n, new)
    assert all(r.json()["usage"]["completion_tokens"] == new for r in responses)
    # n * (new + 1) events (tokens, then done); the loop is also woken once a request by the worker thread
    # that parses it (starlette's run_in_threadpool)
    assert counts["wakeups"] <= counts["steps"] + 2 * n < n * new, counts


def test_a_whole_completions_handler_resumes_once_a_choice_not_once_a_token(monkeypatch):
    """Loop callbacks (task steps, timers, futures' callbacks) per request do not grow with its tokens unless it
    streams: its tokens wait in its mailbox until the choice ends. The handlers' client check every POLL_S seconds
    also resumes them, as often as the wall clock says, not the tokens: it is pushed past the runs here, so that a
    slow or loaded host's longer runs do not count as callbacks the tokens caused."""
    monkeypatch.setattr("plait.serve.server.POLL_S", 60.0)
    n, extra = 4, 4 * (32 - 4)  # tokens more in the second run
    few, many = _serve(n, 4)[1]["callbacks"], _serve(n, 32)[1]["callbacks"]
    assert many - few < extra / 4, f"{few} loop callbacks for {n} x 4 tokens, {many} for {n} x 32"
    streamed = _serve(n, 32, stream=True)[1]["callbacks"]
    assert streamed - many >= n * 32, "a stream's handler resumes at each token"


def test_the_http_rank_leaves_a_core_to_its_http_thread():
    """Rank 0 runs one intra-op thread fewer than it was given (never none): its HTTP thread gets a core instead
    of stalling the forward's threads at every parallel operation."""
    from plait.serve.job import leave_a_core

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert leave_a_core() == 3 and torch.get_num_threads() == 3
        torch.set_num_threads(1)
        assert leave_a_core() == 1
    finally:
        torch.set_num_threads(threads)
