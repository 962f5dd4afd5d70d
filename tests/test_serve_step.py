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


def test_a_steps_events_wake_the_http_loop_about_once_not_once_a_token():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96)).eval()
    runner = Runner(model, num_blocks=64, block_size=4)
    steps = [0]
    execute = runner.execute

    def counted(step):
        steps[0] += bool(step.rows)
        return execute(step)

    runner.execute = counted  # type: ignore[method-assign]
    engine = Engine(runner, Scheduler(BlockAllocator(64, 4), max_batch=8), TOK, Metrics(), distributed=False)
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    api = Api(engine, Limits("m", 96, 256, 16, 256), TokenizerInfo(TOK, "/nonexistent", 96), Metrics(), max_queue=64)
    n, new = 8, 16

    async def main() -> tuple[list[httpx.Response], int]:
        loop = asyncio.get_running_loop()
        wakeups, threadsafe = [0], loop.call_soon_threadsafe

        def count(*args, **kwargs):
            wakeups[0] += 1
            return threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = count  # type: ignore[method-assign]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app()), base_url="http://plait") as c:
            body = {"model": "m", "max_tokens": new, "temperature": 0, "ignore_eos": True}
            res = await asyncio.gather(*[c.post("/v1/completions", json={**body, "prompt": f"prompt {i}"})
                                         for i in range(n)])
        return res, wakeups[0]

    try:
        assert engine.ready.wait(30)
        responses, wakeups = asyncio.run(main())
    finally:
        engine.stopping.set()
        thread.join(10)
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == new for r in responses)
    # n * (new + 1) events (tokens, then done); the loop is also woken once a request by the worker thread
    # that parses it (starlette's run_in_threadpool)
    assert wakeups <= steps[0] + 2 * n < n * new, f"{wakeups} wake-ups of the loop for {steps[0]} steps"
