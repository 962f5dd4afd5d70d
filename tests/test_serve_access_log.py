"""plait serve's request log, in one process over a scripted engine: each completion's line names its response id
and how it ended (finish reasons, or the client leaving a stream, which still shows status 200), each error line
its message, and the routes that probes poll stay out of INFO."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import httpx
import pytest

from plait.serve.metrics import Metrics
from plait.serve.protocol import Limits
from plait.serve.server import Api
from plait.serve.tokens import TokenizerInfo
from plait.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
pytestmark = pytest.mark.timeout(60)


class _Script:
    """An engine whose every request gets the tokens of ``text`` (one each ``gap`` seconds, from a thread), then
    ``end``: a finish reason, or an error event when it is "error"."""

    failed = None
    stop_reason = ""

    def __init__(self, text: str = "abc", end: str = "length", gap: float = 0.0):
        self.text, self.end, self.gap = text, end, gap
        self.ready = threading.Event()
        self.ready.set()
        self.cancelled: list[int] = []
        self.rid = 0

    def submit(self, req) -> int:
        self.rid += 1
        threading.Thread(target=self._run, args=(req, self.rid), daemon=True).start()
        return self.rid

    def _run(self, req, rid: int) -> None:
        for ch in self.text:
            if rid in self.cancelled:
                return
            self._emit(req, {"type": "token", "id": ord(ch), "text": ch, "logprob": None})
            time.sleep(self.gap)
        self._emit(req, {"type": "error", "message": "the engine stopped: rank 1 died", "status": 500, "code": None}
                   if self.end == "error" else {"type": "done", "finish_reason": self.end, "text": ""})

    @staticmethod
    def _emit(req, event: dict) -> None:
        req.sink(event)
        if req.wake is not None:
            req.wake()

    def cancel(self, rid: int) -> None:
        self.cancelled.append(rid)

    def queue_depth(self) -> int:
        return 0

    def stalled(self) -> None:
        return None


def _app(engine: _Script, logger: logging.Logger):
    limits = Limits("m", 64, 256, 16, 64)
    return Api(engine, limits, TokenizerInfo(TOK, "/nonexistent", 64), Metrics(), max_queue=4).app(access_log=logger)


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.DEBUG, logger="plait.serve.test")
    return logging.getLogger("plait.serve.test")


def _lines(caplog, level: int | None = None) -> list[str]:
    return [r.getMessage() for r in caplog.records if level is None or r.levelno == level]


def _call(app, method: str, path: str, body: dict | None = None) -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://plait") as c:
            return await c.request(method, path, json=body)
    return asyncio.run(main())


def test_a_completions_line_names_its_id_tokens_and_finish_and_an_errors_line_its_message(log, caplog):
    app = _app(_Script("abc", "stop"), log)
    res = _call(app, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 5})
    assert res.status_code == 200
    [line] = _lines(caplog, logging.INFO)
    assert f'"POST /v1/completions" 200 id={res.json()["id"]} prompt_tokens=2 completion_tokens=3 finish=stop' in line
    caplog.clear()
    res = _call(app, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 500})
    assert res.status_code == 400
    message = res.json()["error"]["message"]
    [line] = _lines(caplog, logging.INFO)
    assert line.endswith(f" error={json.dumps(message)}") and "max_tokens=500" in message


def test_polled_routes_log_at_debug_an_engine_error_with_its_message_at_warning_unless_streamed(log, caplog):
    app = _app(_Script("ab", "error"), log)
    assert _call(app, "GET", "/health").status_code == 200
    assert _call(app, "GET", "/metrics").status_code == 200
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.DEBUG]
    caplog.clear()
    res = _call(app, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
    assert res.status_code == 200 and "rank 1 died" in res.text
    [line] = _lines(caplog)
    assert "completion_tokens=2 finish=error" in line and line.endswith('error="the engine stopped: rank 1 died"')
    caplog.clear()
    res = _call(app, "POST", "/v1/completions", {"model": "m", "prompt": "hi"})
    assert res.status_code == 500
    assert "finish=error" in _lines(caplog, logging.WARNING)[0]


# Starlette watches for the disconnect itself before ASGI 2.4; from 2.4 a send to the closed connection fails (as
# uvicorn's), or the handler's own look at the connection finds it gone first
@pytest.mark.parametrize("spec, send_fails", [("2.3", False), ("2.4", True), ("2.4", False)])
def test_a_stream_its_client_left_is_logged_as_disconnected_not_as_a_whole_200(log, caplog, spec, send_fails):
    engine = _Script("abcdefghijklmnop", "length", gap=0.05)
    app = _app(engine, log)
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 16, "stream": True}).encode()

    async def main():
        left = asyncio.Event()
        incoming = [{"type": "http.request", "body": body, "more_body": False}]
        chunks = []

        async def receive():
            if incoming:
                return incoming.pop()
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                if len(chunks) == 3:
                    left.set()
                if left.is_set() and send_fails:
                    raise OSError("the client went away")

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 5555), "server": ("plait", 80)}
        try:
            await app(scope, receive, send)
        except Exception:  # Starlette's ClientDisconnect under 2.4, as uvicorn sees it
            pass
        return chunks

    chunks = asyncio.run(main())
    assert 3 <= len(chunks) < 16
    [line] = _lines(caplog)
    assert '"POST /v1/completions" 200 id=cmpl-' in line and "finish=disconnected" in line, line
    assert engine.cancelled or "completion_tokens=16" not in line
