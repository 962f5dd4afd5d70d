"""plait serve over tp 2 x pp 2: tokens equal plait generate, logprobs one device's; a killed worker stops it."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from plait.generation.job import load_model
from plait.tokenizers import ByteTokenizer
from serve_util import Server, expected_ids, log_softmax, tiny_model, workers

pytestmark = pytest.mark.timeout(420)
TOK = ByteTokenizer()


def _health(url: str) -> int | None:
    """/health's status code, or None when nothing answers."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def _check_logprobs(client, ref) -> None:
    """Echoed prompt and sampled logprobs from vocabulary-sharded logits equal log_softmax on one device."""
    prompt = TOK.encode("sharded vocabulary, chunked prompt")
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, logprobs=2, echo=True,
                                    temperature=0.9, seed=4, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    ids = prompt + out.token_ids
    assert out.token_ids == expected_ids(ref, prompt, 3, 0.9, 0, 4)
    lsm = log_softmax(ref, ids)
    lps = out.logprobs.token_logprobs
    assert lps[0] is None and max(abs(lps[j] - lsm[j - 1, ids[j]].item()) for j in range(1, len(ids))) < 1e-5
    for j in range(1, len(ids)):
        best = lsm[j - 1].topk(2)
        want = {f"token_id:{t}": v for t, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)}
        want[f"token_id:{ids[j]}"] = lsm[j - 1, ids[j]].item()
        top = out.logprobs.top_logprobs[j]
        assert top.keys() == want.keys() and max(abs(top[k] - want[k]) for k in top) < 1e-5


def test_tp2_pp2_serves_generate_tokens_then_a_killed_worker_stops_it(tmp_path):
    model_dir = tiny_model(tmp_path / "tiny")
    ref = load_model(str(model_dir))[0]
    server = Server(model_dir, tmp_path, "--tp", "2", "--pp", "2", "--max-batch", "6", "--kv-block", "4",
                    "--step-tokens", "8")
    try:
        server.wait_healthy(timeout=240)  # four processes loading on a busy machine
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        jobs = [(f"{i} + {i} = ", 3 + i % 6, 0.0 if i % 3 else 0.7, i) for i in range(12)]

        def ask(job):
            prompt, n, temperature, seed = job
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=temperature,
                                            seed=seed)
            return out.choices[0].token_ids

        with ThreadPoolExecutor(12) as pool:
            got = list(pool.map(ask, jobs))
        for (prompt, n, temperature, seed), ids in zip(jobs, got, strict=True):
            assert ids == expected_ids(ref, TOK.encode(prompt), n, temperature, 0, seed), prompt
        stream = client.completions.create(model="tiny", prompt="tp x pp", max_tokens=5, stream=True)
        assert [t for c in stream for t in c.choices[0].token_ids] == expected_ids(ref, TOK.encode("tp x pp"), 5)
        _check_logprobs(client, ref)

        procs = workers(server.proc.pid)
        assert len(procs) == 4, procs
        victim = procs[-1]
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while time.monotonic() < killed + 30 and _health(server.url) == 200:
            time.sleep(0.1)
        assert _health(server.url) != 200, f"/health still ok 30 s after a worker died:\n{server.output()}"
        server.proc.wait(timeout=60)
        # every rank ends soon, not at the launcher's SIGKILL 30 s after it asked them to stop
        assert time.monotonic() - killed < 20, server.output()
        assert server.proc.returncode not in (0, None), server.output()
        assert f"(pid {victim}) died (signal SIGKILL)" in server.output(), server.output()
    finally:
        with contextlib.suppress(Exception):
            server.kill()
