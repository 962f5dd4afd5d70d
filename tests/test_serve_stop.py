"""Ctrl-C / SIGINT stops plait serve cleanly under tp1 and pp2: one line, exit code 0, no traceback; running
requests finish within --shutdown-timeout, those left end with 503 or an error event; the request log."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from plait.generation.job import load_model
from plait.tokenizers import ByteTokenizer
from serve_util import Server, expected_ids, tiny_model

pytestmark = pytest.mark.timeout(420)
TOK = ByteTokenizer()
LONG = {"model": "tiny", "prompt": "a long one", "max_tokens": 110, "ignore_eos": True}


def _stream_until(server: Server, body: dict, started: threading.Event, out: list) -> None:
    """Stream ``body``; ``started`` once its first token came; every data line into ``out``."""
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=240) as res:
        for line in res.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                started.set()
    started.set()


def _stopped_cleanly(server: Server) -> str:
    server.proc.wait(timeout=60)
    text = server.output()
    assert server.proc.returncode == 0, text
    assert text.count("plait serve: stopped (SIGINT)") == 1 and "Traceback" not in text, text
    assert "KeyboardInterrupt" not in text and "Warning" not in text, text
    return text


def test_sigint_twice_with_requests_in_flight_tp1_ends_them_with_503(tmp_path):
    """The first SIGINT drains (60 s of grace), a second one 0.7 s later ends what still runs or waits (12
    requests of 8 x 110 tokens queued one sequence at a time behind a stream: seconds of work on any machine)."""
    server = Server(tiny_model(tmp_path / "tiny"), tmp_path, "--max-batch", "1", "--shutdown-timeout", "60",
                    "--no-access-log")
    try:
        server.wait_healthy()
        started, lines, answers = threading.Event(), [], []
        streamer = threading.Thread(target=_stream_until, args=(server, LONG, started, lines))
        streamer.start()
        assert started.wait(60) and lines
        waiting = [threading.Thread(target=lambda: answers.append(
            httpx.post(f"{server.url}/v1/completions", json={**LONG, "n": 8}, timeout=120))) for _ in range(12)]
        for w in waiting:
            w.start()  # queued behind the stream (--max-batch 1)
        deadline = time.monotonic() + 20
        while server.metric("plait_queue_depth") < 80 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.metric("plait_queue_depth") >= 80, server.output()
        os.kill(server.proc.pid, signal.SIGINT)  # drains: 97 x 110 tokens one sequence at a time
        time.sleep(0.7)
        assert server.metric("plait_queue_depth") > 0, server.output()  # still draining
        os.kill(server.proc.pid, signal.SIGINT)  # again: now
        for t in (streamer, *waiting):
            t.join(60)
        codes = sorted(a.status_code for a in answers)
        assert len(codes) == 12 and codes[-1] == 503 and set(codes) <= {200, 503}, (codes, server.output())
        for a in answers:
            body = a.json()
            assert body["error"]["code"] == "shutting_down" if a.status_code == 503 else \
                [len(c["token_ids"]) for c in body["choices"]] == [LONG["max_tokens"]] * 8
        end = lines[-1]
        assert end == "[DONE]" or json.loads(end)["error"]["code"] == "shutting_down", lines[-3:]
        late = [a.json()["error"]["message"] for a in answers if a.status_code == 503]
        ended = ["stopped (SIGINT) before this request finished" in m for m in late]
        # queued ones are ended by the second SIGINT; one a loaded host delivered after the first is refused
        assert any(ended) and all(e or "shutting down (SIGINT)" in m for e, m in zip(ended, late, strict=True)), late
        text = _stopped_cleanly(server)
        assert "SIGINT again: ending the running requests now" in text
        assert '"POST /v1/completions"' not in text  # --no-access-log
    finally:
        server.kill()


def test_ctrl_c_pp2_finishes_running_requests_refuses_new_ones_and_logs_them(tmp_path):
    """Ctrl-C while a stream runs and a request of n=4 waits behind it (--max-batch 1): both finish with one
    device's tokens, a request that comes during the drain gets 503, /health says stopping."""
    model_dir = tiny_model(tmp_path / "tiny")
    ref = load_model(str(model_dir))[0]
    server = Server(model_dir, tmp_path, "--pp", "2", "--max-batch", "1", "--shutdown-timeout", "120")
    try:
        server.wait_healthy(timeout=240)
        started, lines, answers = threading.Event(), [], []
        streamer = threading.Thread(target=_stream_until, args=(server, LONG, started, lines))
        streamer.start()
        assert started.wait(60) and lines
        waiting = [threading.Thread(target=lambda: answers.append(
            httpx.post(f"{server.url}/v1/completions", json={**LONG, "n": 4}, timeout=240)))]
        for w in waiting:
            w.start()
        def arrived() -> bool:
            """The n=4 request is in and not yet answered: queued behind the stream, or, once the stream has
            ended, whatever still runs or waits is its (its four sequences run one at a time: a window of seconds
            even where this thread's polls come late on a loaded host)."""
            inside = server.metric("plait_queue_depth") + server.metric("plait_batch_size")
            return inside >= 2 or (not streamer.is_alive() and not answers and inside >= 1)

        deadline = time.monotonic() + 60
        while not arrived() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert arrived(), server.output()
        os.killpg(server.proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the launcher and every worker
        time.sleep(0.2)
        try:
            late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=30)
        except httpx.HTTPError as exc:
            raise AssertionError(f"{exc!r}\n{server.output()}") from None
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
        assert httpx.get(f"{server.url}/health", timeout=30).json() == {"status": "stopping", "reason": "SIGINT"}
        for t in (streamer, *waiting):
            t.join(240)
        want = expected_ids(ref, TOK.encode(LONG["prompt"]), LONG["max_tokens"])
        assert lines[-1] == "[DONE]", lines[-3:]
        assert [t for line in lines[:-1] for t in json.loads(line)["choices"][0]["token_ids"]] == want
        assert [a.status_code for a in answers] == [200], [a.text for a in answers]
        assert [c["token_ids"] for a in answers for c in a.json()["choices"]] == [want] * 4
        text = _stopped_cleanly(server)
        done = [ln for ln in text.splitlines() if '"POST /v1/completions" 200' in ln]
        assert len(done) == 2 and all(ln.startswith("INFO plait.serve: 127.0.0.1:") for ln in done), done
        assert sorted(ln.split("completion_tokens=")[1].split()[0] for ln in done) == ["110", "440"], done
        assert all("prompt_tokens=10 completion_tokens=" in ln and "total_ms=" in ln for ln in done)
        assert "ttft_ms=-" not in text and '"POST /v1/completions" 503 total_ms=' in text
    finally:
        server.kill()
