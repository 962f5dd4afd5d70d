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

pytestmark = pytest.mark.timeout(300)
TOK = ByteTokenizer()
LONG = {"model": "tiny", "prompt": "a long one", "max_tokens": 110, "ignore_eos": True}


def _stream_until(server: Server, body: dict, started: threading.Event, out: list) -> None:
    """Stream ``body``; ``started`` once its first token came; every data line into ``out``."""
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=120) as res:
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
    """The first SIGINT drains (60 s of grace), a second one 0.7 s later ends what still runs or waits."""
    server = Server(tiny_model(tmp_path / "tiny"), tmp_path, "--max-batch", "1", "--shutdown-timeout", "60",
                    "--no-access-log")
    try:
        server.wait_healthy()
        started, lines, answers = threading.Event(), [], []
        streamer = threading.Thread(target=_stream_until, args=(server, LONG, started, lines))
        streamer.start()
        assert started.wait(60) and lines
        waiting = [threading.Thread(target=lambda: answers.append(
            httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=120))) for _ in range(3)]
        for w in waiting:
            w.start()  # queued behind the stream (--max-batch 1)
        deadline = time.monotonic() + 20
        while server.metric("plait_queue_depth") < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(server.proc.pid, signal.SIGINT)  # drains: 4 x 110 tokens one at a time
        time.sleep(0.7)
        os.kill(server.proc.pid, signal.SIGINT)  # again: now
        for t in (streamer, *waiting):
            t.join(60)
        codes = sorted(a.status_code for a in answers)
        assert len(codes) == 3 and codes[-1] == 503 and set(codes) <= {200, 503}, codes
        for a in answers:
            body = a.json()
            assert body["error"]["code"] == "shutting_down" if a.status_code == 503 else \
                len(body["choices"][0]["token_ids"]) == LONG["max_tokens"]
        end = lines[-1]
        assert end == "[DONE]" or json.loads(end)["error"]["code"] == "shutting_down", lines[-3:]
        late = [a.json()["error"]["message"] for a in answers if a.status_code == 503]
        assert all("stopped (SIGINT) before this request finished" in m for m in late), late
        text = _stopped_cleanly(server)
        assert "SIGINT again: ending the running requests now" in text
        assert '"POST /v1/completions"' not in text  # --no-access-log
    finally:
        server.kill()


def test_ctrl_c_pp2_finishes_running_requests_refuses_new_ones_and_logs_them(tmp_path):
    model_dir = tiny_model(tmp_path / "tiny")
    ref = load_model(str(model_dir))[0]
    server = Server(model_dir, tmp_path, "--pp", "2")
    try:
        server.wait_healthy(timeout=240)
        started, lines = threading.Event(), []
        streamer = threading.Thread(target=_stream_until, args=(server, LONG, started, lines))
        streamer.start()
        assert started.wait(60) and lines
        os.killpg(server.proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: the launcher and every worker
        time.sleep(0.2)
        late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "too late", "max_tokens": 2}, timeout=30)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
        assert httpx.get(f"{server.url}/health", timeout=30).json() == {"status": "stopping", "reason": "SIGINT"}
        streamer.join(120)
        assert lines[-1] == "[DONE]", lines[-3:]
        ids = [t for line in lines[:-1] for t in json.loads(line)["choices"][0]["token_ids"]]
        assert ids == expected_ids(ref, TOK.encode(LONG["prompt"]), LONG["max_tokens"])
        text = _stopped_cleanly(server)
        line = next(ln for ln in text.splitlines() if '"POST /v1/completions" 200' in ln)
        assert line.startswith("INFO plait.serve: 127.0.0.1:") and "prompt_tokens=10 completion_tokens=110" in line
        assert "ttft_ms=" in line and "ttft_ms=-" not in line and "total_ms=" in line
        assert '"POST /v1/completions" 503 prompt_tokens' not in text and '"POST /v1/completions" 503' in text
    finally:
        server.kill()
