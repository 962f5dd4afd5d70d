"""plait serve (pp 2) with the openai client on 127.0.0.1: chat, streaming, 32 concurrent, bad input, disconnect."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from plait.chat_template import chat_prompt
from plait.tokenizers import ByteTokenizer
from serve_util import expected_ids, tiny_model

pytestmark = pytest.mark.timeout(240)
TOK = ByteTokenizer()


def test_models_completion_and_chat(served):
    client, ref, eos = served.client, served.ref, served.eos
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    out = client.completions.create(model="tiny", prompt="def main(): pass", max_tokens=8)
    want = expected_ids(ref, TOK.encode("def main(): pass"), 8, eos=eos)
    assert out.choices[0].token_ids == want and len(want) == 8 and eos not in want
    assert out.choices[0].text == TOK.decode(want) and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 16 and out.usage.completion_tokens == 8
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=5).choices[0].token_ids
    assert ids == expected_ids(ref, [5, 6, 7, 8], 5, eos=eos)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    want = expected_ids(ref, TOK.encode(chat_prompt(messages)), 6, eos=eos)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == TOK.decode(want)
    assert chat.choices[0].token_ids == want


def test_streaming_completion_and_chat(served):
    client, ref, eos = served.client, served.ref, served.eos
    chunks = list(client.completions.create(model="tiny", prompt="import os", max_tokens=10, stream=True))
    ids = [t for c in chunks for t in c.choices[0].token_ids]
    want = expected_ids(ref, TOK.encode("import os"), 10, eos=eos)
    assert ids == want and len(want) == 10
    assert len(chunks) == 11 and chunks[-1].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Hello"}]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=7, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    want = expected_ids(ref, TOK.encode(chat_prompt(messages)), 7, eos=eos)
    assert text == TOK.decode(want[:-1] if want[-1] == eos else want)


def test_32_concurrent_requests_equal_generate_alone(served):
    server, client, ref = served.server, served.client, served.ref
    steps0 = server.metric("plait_engine_steps_total")
    jobs = [(f"request {i}: " + "x" * (i % 7), 4 + i % 9, 0.0 if i % 2 else 0.8, 20 if i % 4 == 0 else 0, i)
            for i in range(32)]

    def ask(job):
        prompt, n, temperature, top_k, seed = job
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=temperature,
                                        seed=seed, extra_body={"top_k": top_k}, timeout=120)
        return out.choices[0].token_ids

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(ask, jobs))
    for (prompt, n, temperature, top_k, seed), ids in zip(jobs, got, strict=True):
        assert ids == expected_ids(ref, TOK.encode(prompt), n, temperature, top_k, seed, eos=served.eos), prompt
    steps = server.metric("plait_engine_steps_total") - steps0  # one at a time: >= sum(n) steps, more with chunks
    assert steps < 0.75 * sum(job[1] for job in jobs), "requests were not batched together"
    assert server.metric("plait_kv_tokens_used") == 0 and server.metric("plait_batch_size") == 0
    assert server.metric("plait_time_to_first_token_seconds_count") >= 32


@pytest.mark.parametrize("body,status,param,code", [
    ('{"model": "tiny", "prompt": ', 400, None, "invalid_json"),
    ('["not", "an", "object"]', 400, None, None),
    ('{"model": "gpt-17", "prompt": "hi"}', 404, "model", "model_not_found"),
    (json.dumps({"model": "tiny", "prompt": "x" * 200}), 400, "prompt", "context_length_exceeded"),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": -1}', 400, "max_tokens", None),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": 1000000000}', 400, "max_tokens", None),
    (json.dumps({"model": "tiny", "prompt": "x" * 50, "max_tokens": 75}), 400, "max_tokens", "kv_budget_exceeded"),
    ('{"model": "tiny", "prompt": [1, 2, 999]}', 400, "prompt", None),
    ('{"model": "tiny", "prompt": ""}', 400, "prompt", None),
    ('{"model": "tiny", "prompt": "hi", "best_of": 3}', 400, "best_of", "unsupported"),
    ('{"model": "tiny", "prompt": "hi", "frobnicate": 1}', 400, "frobnicate", "unsupported"),
    ('{"model": "tiny", "prompt": "hi", "n": 0}', 400, "n", None),
    ('{"model": "tiny", "prompt": "hi", "temperature": "hot"}', 400, "temperature", None),
])
def test_bad_input_gets_an_openai_error_body(served, body, status, param, code):
    res = httpx.post(f"{served.server.url}/v1/completions", content=body,
                     headers={"content-type": "application/json", **served.headers})
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param and err["code"] == code
    assert err["type"] == "invalid_request_error"


def test_errors_through_the_client_and_still_serving(served):
    server, client, ref = served.server, served.client, served.ref
    rejected0 = server.metric('plait_requests_total{status="rejected"}')
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny", prompt="y" * 120, max_tokens=20)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    res = httpx.get(f"{server.url}/v1/nothing-here", headers=served.headers)
    assert res.status_code == 404 and "error" in res.json()
    out = client.completions.create(model="tiny", prompt="still there?", max_tokens=3)
    assert out.choices[0].token_ids == expected_ids(ref, TOK.encode("still there?"), 3, eos=served.eos)
    # the three refused requests above are counted, each once (the unknown path is not a request)
    assert server.metric('plait_requests_total{status="rejected"}') - rejected0 == 3


def _ended(server) -> tuple[float, float]:
    """Requests the server counted cancelled and finished (ok) so far."""
    return (server.metric('plait_requests_total{status="cancelled"}'),
            server.metric('plait_requests_total{status="ok"}'))


def test_client_leaving_mid_stream_cancels_and_frees_the_slot(served):
    """The client reads three events of a 100-token stream and leaves: the server cancels the rest and frees its
    KV cache. The server streams 100 tokens in well under a second; a client not scheduled for that long (a busy
    host) leaves a stream that already ended (counted ok, its tokens in the socket buffers): that try did not
    test a client leaving mid-stream, and the next one does."""
    server, client, ref = served.server, served.client, served.ref
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 100, "stream": True, "ignore_eos": True}
    for _ in range(5):
        cancelled0, ok0 = _ended(server)
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30, headers=served.headers) as res:
            lines = res.iter_lines()
            seen = [ln for ln, _ in zip(lines, range(6), strict=False) if ln.startswith("data: ")]
        assert len(seen) >= 2
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and sum(_ended(server)) == cancelled0 + ok0:
            time.sleep(0.1)
        cancelled, ok = _ended(server)
        assert (cancelled - cancelled0, ok - ok0) in ((1, 0), (0, 1)), "the stream the client left never ended"
        if cancelled == cancelled0 + 1:
            break
    else:
        raise AssertionError("five streams each ended before their client left: none tested a client leaving")
    assert server.metric("plait_kv_tokens_used") == 0 and server.metric("plait_batch_size") == 0
    out = client.completions.create(model="tiny", prompt="after", max_tokens=4)
    assert out.choices[0].token_ids == expected_ids(ref, TOK.encode("after"), 4, eos=served.eos)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_bad_flags_fail_before_launching(tmp_path):
    from typer.testing import CliRunner

    from plait.cli.main import app

    model_dir = tiny_model(tmp_path / "m")
    res = CliRunner().invoke(app, ["serve", "--model", str(tmp_path / "nope")])
    assert res.exit_code == 2 and res.output.startswith("error: --model") and "no such folder" in res.output
    res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--max-tokens", "500"])
    assert res.exit_code == 2 and "--max-tokens 500 must be within [1, 127]" in res.output
    res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--kv-budget", "64", "--max-tokens", "100"])
    assert res.exit_code == 2 and res.output.startswith(  # was accepted: every request over 63 tokens got 400
        "error: --max-tokens 100: every request would need more KV cache positions than --kv-budget 64 holds (its "
        "prompt, 1 token at least, and max_tokens): the largest --max-tokens that fits is 63, or raise --kv-budget "
        "to 101"), res.output
    from plait.serve.config import ServeConfig

    assert ServeConfig(kv_budget=64).resolved(128).max_tokens == 63  # the default: what fits the pool
    assert ServeConfig(kv_budget=64, max_tokens=63).resolved(128).max_tokens == 63
    assert ServeConfig().resolved(128).max_tokens == 127
    res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--step-tokens", "-1"])
    assert res.exit_code == 2 and "--step-tokens -1" in res.output
    res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--kv-block", "0"])
    assert res.exit_code == 2 and "--kv-block 0" in res.output
    res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--tp", "3"])
    assert res.exit_code == 2 and res.output.startswith("error: --tp 3 does not fit --model"), res.output
    res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--port", "70000"])
    assert res.exit_code == 2 and "--port 70000: must be a TCP port within [1, 65535]" in res.output, res.output
    res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--step-timeout", "1", "--pp", "2"])
    assert res.exit_code == 2 and "--step-timeout 1.0 must be >= 2 seconds" in res.output, res.output
    res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--step-timeout", "30"])  # was ignored
    assert res.exit_code == 2 and res.output.startswith("error: --step-timeout 30: one process (--tp 1 --pp 1) "
                                                        "waits for no other rank"), res.output
    res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--kv-reserve", "--prefix-cache"])
    assert res.exit_code == 2 and res.output.startswith("error: --prefix-cache: not with --kv-reserve"), res.output
    res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--log-level", "loud"])
    assert res.exit_code == 2 and "--log-level loud: choose debug, info, warning or error" in res.output
    res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--dtype", "float64"])
    assert res.exit_code == 2 and "--dtype float64: choose float32, bfloat16 or float16" in res.output
    res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--chat-template", "{% for m in messages %}"])
    assert res.exit_code == 2 and "--chat-template" in res.output and "TemplateSyntaxError" in res.output, res.output
    res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--chat-template", "tmpl/chat.jinja"])
    assert res.exit_code == 2 and "--chat-template tmpl/chat.jinja: no such file" in res.output, res.output
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        res = CliRunner().invoke(app, ["serve", "--model", str(model_dir), "--port", str(busy.getsockname()[1])])
    assert res.exit_code == 2 and "cannot listen there" in res.output, res.output


def test_non_streaming_client_leaving_frees_its_sequence(served):
    """The client gives up after 0.3 s on 4 choices of up to 112 positions each, more than the KV budget holds
    at once: every choice still running or waiting is cancelled (at least one; a fast server may have finished
    the first), none is left running, and the KV cache and the batch are empty again. A client not scheduled
    for the seconds the whole answer takes gets it (4 full choices) before its timeout: that try did not test a
    client leaving, and the next one does."""
    server = served.server
    body = {"model": "tiny", "prompt": "no one waits", "max_tokens": 100, "ignore_eos": True, "n": 4}
    for _ in range(5):
        cancelled0, ok0 = _ended(server)
        try:
            res = httpx.post(f"{server.url}/v1/completions", json=body, headers=served.headers, timeout=0.3)
        except httpx.TimeoutException:
            break
        assert res.status_code == 200, res.text
        assert [len(c["token_ids"]) for c in res.json()["choices"]] == [100] * 4
    else:
        raise AssertionError("five answers each came before their client's timeout: none tested a client leaving")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sum(_ended(server)) < cancelled0 + ok0 + 4:
        time.sleep(0.1)
    cancelled, ok = _ended(server)
    gone, done = cancelled - cancelled0, ok - ok0
    assert gone >= 1 and gone + done == 4, (gone, done)
    assert server.metric("plait_kv_tokens_used") == 0 and server.metric("plait_batch_size") == 0


def test_paged_kv_runs_more_than_a_reservation_admits_preempts_and_still_equals_generate(served):
    """4 x (prompt + 100 tokens) need 4 x ~110 positions; the pool holds 120: a reservation runs one at a time."""
    server, client, ref = served.server, served.client, served.ref
    steps0, preempted0 = server.metric("plait_engine_steps_total"), server.metric("plait_preemptions_total")
    jobs = [(f"paged {i}", 0.0 if i % 2 else 0.9, i) for i in range(4)]

    def ask(job):
        prompt, temperature, seed = job
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=100, temperature=temperature,
                                         seed=seed, extra_body={"ignore_eos": True}, timeout=120).choices[0].token_ids

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ask, jobs))
    for (prompt, temperature, seed), ids in zip(jobs, got, strict=True):
        assert ids == expected_ids(ref, TOK.encode(prompt), 100, temperature, 0, seed), prompt
    assert server.metric("plait_preemptions_total") > preempted0
    assert server.metric("plait_engine_steps_total") - steps0 < 4 * 100, "the sequences never ran together"
    assert server.metric("plait_kv_tokens_used") == 0


def test_chunked_prefill_splits_a_long_prompt_with_equal_tokens(served):
    server, client, ref = served.server, served.client, served.ref
    prompt = "a prompt of forty bytes, in three chunks"
    chunks0 = server.metric("plait_prefill_chunks_total")
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True})
    assert out.choices[0].token_ids == expected_ids(ref, TOK.encode(prompt), 5)
    assert server.metric("plait_prefill_chunks_total") - chunks0 == 3  # 16 + 16 + 8 tokens (--step-tokens 16)


def test_prefix_cache_serves_a_shared_prompt_prefix_with_equal_tokens(served):
    """Two requests that share a 40-byte system prompt (pp 2, 4-position blocks): the second starts from the
    first one's cached blocks on both stages and gives the same tokens as one device."""
    server, client, ref = served.server, served.client, served.ref
    system = "You are a terse assistant. Answer in one "
    cached0 = server.metric("plait_prefix_cache_tokens_total")
    for question in ("line.", "word, please."):
        prompt = system + question
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True})
        assert out.choices[0].token_ids == expected_ids(ref, TOK.encode(prompt), 6), question
    assert server.metric("plait_prefix_cache_tokens_total") - cached0 >= 40  # the second prefilled only the rest
    assert server.metric("plait_kv_tokens_used") == 0
