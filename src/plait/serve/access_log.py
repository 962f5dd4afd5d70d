"""plait serve's request log: one line per request once its response is sent (a stream: once it ends)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

#: routes polled by probes and scrapers: their successful answers are logged at DEBUG, not once a poll at INFO
POLLED = ("/health", "/metrics")
ERROR_CHARS = 300  # the most of an error's message a line carries
ERROR_BODY_BYTES = 64 << 10  # the most of an error response's body read for its message


@dataclass
class Generation:
    """What the log line of a completion tells beyond the HTTP exchange: the response's ``id``, its prompt and
    generated tokens, when the first token arrived, how it ended (``end``: "disconnected", "timeout" or "error"
    when it did not run to its finish reasons, which ``finish`` holds per choice) and an error event's
    ``error`` (a stream's status is 200 whatever happens after its first byte)."""

    id: str
    prompt: int
    completion: int = 0
    first: float | None = None
    finish: list[str | None] | None = None
    end: str | None = None
    error: str | None = None

    def ended(self) -> str:
        """How the request ended: its ``end``, else its choices' distinct finish reasons in order ("stop,length");
        "disconnected" when its handler never recorded them (a stream the server dropped when its client left)."""
        if self.end is not None:
            return self.end
        if self.finish is None:
            return "disconnected"
        return ",".join(dict.fromkeys(f or "-" for f in self.finish))


class AccessLog:
    """ASGI middleware: one line per request: client, method, path, status; for a completion its id, prompt and
    completion tokens, how it ended (finish reasons, or disconnected/timeout/error), time to first token; for an
    error its message. INFO, except a polled route's success (DEBUG) and a server error (WARNING)."""

    def __init__(self, app, logger: logging.Logger):
        self.app, self.log = app, logger

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status, body = time.monotonic(), [500], bytearray()  # 500 unless a response starts

        async def sent(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif status[0] >= 400 and len(body) < ERROR_BODY_BYTES:
                body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            level = (logging.WARNING if status[0] >= 500 else
                     logging.DEBUG if status[0] < 400 and scope["path"] in POLLED else logging.INFO)
            if self.log.isEnabledFor(level):
                self.log.log(level, line(scope, status[0], start, time.monotonic(), error_message(bytes(body))))


def line(scope, status: int, start: float, end: float, error: str | None = None) -> str:
    """The log line of one request (``error``: the message of its error response, if any)."""
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    out = f'{who} "{scope["method"]} {scope["path"]}" {status}'
    gen = scope.get("state", {}).get("generation")
    if isinstance(gen, Generation):
        ttft = "-" if gen.first is None else f"{(gen.first - start) * 1e3:.0f}"
        out += (f" id={gen.id} prompt_tokens={gen.prompt} completion_tokens={gen.completion} finish={gen.ended()}"
                f" ttft_ms={ttft}")
        error = error or gen.error
    out += f" total_ms={(end - start) * 1e3:.0f}"
    if error:
        cut = error if len(error) <= ERROR_CHARS else error[:ERROR_CHARS] + "..."
        out += f" error={json.dumps(cut, ensure_ascii=False)}"
    return out


def error_message(body: bytes) -> str | None:
    """The message of an OpenAI-style error body ({"error": {"message"}}), else its text; None when empty."""
    if not body:
        return None
    try:
        doc = json.loads(body)
    except ValueError:
        return body.decode("utf-8", errors="replace").strip() or None
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    return json.dumps(doc, ensure_ascii=False)
