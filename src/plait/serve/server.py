"""The OpenAI-compatible HTTP server (FastAPI on uvicorn, in a thread of rank 0) and the serving worker job."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from dataclasses import replace
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from plait.serve.engine import Engine
from plait.serve.engine import Request as GenRequest
from plait.serve.metrics import Metrics
from plait.serve.protocol import ApiError, Limits, Parsed, choice, envelope, error_body, new_id, parse, usage

POLL_S = 0.5  # how often a waiting handler checks whether its client went away


class TextStream:
    """Incremental detokenisation: the new text of each token, holding back an incomplete UTF-8 sequence."""

    def __init__(self, tok):
        self.tok, self.ids, self.sent = tok, [], 0

    def push(self, tok_id: int | None, final: bool = False) -> str:
        if tok_id is not None:
            self.ids.append(tok_id)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta


def _post(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, index: int, event: dict) -> None:
    """Engine thread -> the handler's event loop."""
    try:
        loop.call_soon_threadsafe(q.put_nowait, (index, event))
    except RuntimeError:  # the loop is gone (server shutting down)
        pass


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Api:
    """The routes, over an ``Engine`` (rank 0) that runs the requests."""

    def __init__(self, engine: Engine, limits: Limits, tok, metrics: Metrics, max_queue: int):
        self.engine, self.limits, self.tok, self.metrics, self.max_queue = engine, limits, tok, metrics, max_queue
        self.created = int(time.time())

    def app(self) -> FastAPI:
        app = FastAPI(title="plait serve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(StarletteHTTPException, self._http_error)
        app.add_exception_handler(Exception, self._server_error)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(partial(self.generate, chat=False))
        app.post("/v1/chat/completions")(partial(self.generate, chat=True))
        return app

    async def _http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", kind), exc.status_code)

    async def _server_error(self, request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500)

    async def health(self) -> JSONResponse:
        if self.engine.failed:
            return JSONResponse({"status": "failed", "reason": self.engine.failed}, 503)
        if not self.engine.ready.is_set():
            return JSONResponse({"status": "starting"}, 503)
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> PlainTextResponse:
        self.metrics.queue_depth = self.engine.queue_depth()
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self) -> JSONResponse:
        card = {"id": self.limits.model, "object": "model", "created": self.created, "owned_by": "plait",
                "max_model_len": self.limits.context}
        return JSONResponse({"object": "list", "data": [card]})

    async def generate(self, request: Request, chat: bool):
        try:
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
            p = parse(body, chat, self.tok, self.limits)
            if self.engine.failed or not self.engine.ready.is_set():
                raise ApiError(503, "the engine is not running", code="engine_unavailable")
            if self.engine.queue_depth() + len(p.prompts) > self.max_queue:
                raise ApiError(503, f"the server is overloaded ({self.max_queue} requests queued); retry later",
                               code="queue_full")
        except ApiError as exc:
            self.metrics.request("rejected")
            return JSONResponse(exc.body(), exc.status)
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        rids = [self.engine.submit(GenRequest(ids, replace(p.sampling), partial(_post, loop, q, i)))
                for i, ids in enumerate(p.prompts)]
        rid = new_id(chat)
        if p.stream:
            return StreamingResponse(self._stream(request, p, rid, rids, q), media_type="text/event-stream")
        return await self._complete(request, p, rid, rids, q)

    async def _next(self, request: Request, q: asyncio.Queue):
        """The next (index, event), or None when the client has disconnected."""
        while True:
            try:
                return await asyncio.wait_for(q.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None

    def _cancel(self, rids: list[int], done: set[int]) -> None:
        for i, r in enumerate(rids):
            if i not in done:
                self.engine.cancel(r)

    async def _complete(self, request: Request, p: Parsed, rid: str, rids: list[int], q: asyncio.Queue) -> Response:
        outs: list[list[int]] = [[] for _ in rids]
        done: set[int] = set()
        try:
            while len(done) < len(rids):
                item = await self._next(request, q)
                if item is None:
                    return Response(status_code=499)  # nobody is listening; the finally cancels
                i, ev = item
                if ev["type"] == "token":
                    outs[i].append(ev["id"])
                elif ev["type"] == "done":
                    done.add(i)
                else:
                    done.update(range(len(rids)))
                    return JSONResponse(error_body(ev["message"], "server_error"), 500)
        finally:
            self._cancel(rids, done)
        choices = [choice(p, i, self.tok.decode(o), o, "length", delta=False) for i, o in enumerate(outs)]
        return JSONResponse({**envelope(p, rid, self.limits.model, choices, chunk=False), "usage": usage(p, outs)})

    async def _stream(self, request: Request, p: Parsed, rid: str, rids: list[int], q: asyncio.Queue):
        done: set[int] = set()
        texts = [TextStream(self.tok) for _ in rids]
        model = self.limits.model
        try:
            if p.chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield _sse(envelope(p, rid, model, [first], chunk=True))
            while len(done) < len(rids):
                item = await self._next(request, q)
                if item is None:
                    return
                i, ev = item
                if ev["type"] == "token":
                    part = choice(p, i, texts[i].push(ev["id"]), [ev["id"]], None, delta=True)
                elif ev["type"] == "done":
                    done.add(i)
                    part = choice(p, i, texts[i].push(None, final=True), [], ev["finish_reason"], delta=True)
                else:
                    done.update(range(len(rids)))
                    yield _sse(error_body(ev["message"], "server_error"))
                    return
                yield _sse(envelope(p, rid, model, [part], chunk=True))
            yield "data: [DONE]\n\n"
        finally:
            self._cancel(rids, done)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound before the workers start serving, so a busy port fails at once)."""
    from plait.errors import ConfigError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    return sock


def serve_job(payload: dict) -> None:
    """Worker entry of ``plait serve``: every rank loads its part; rank 0 also runs the HTTP server."""
    from plait.generation.job import load_model
    from plait.serve.engine import follow
    from plait.serve.runner import Runner

    tp, pp = payload["tp"], payload["pp"]
    model, tok, cfg = load_model(payload["model"], tp, pp)
    runner = Runner(model, payload["max_batch"], cfg.max_seq_len)
    if int(os.environ.get("RANK", "0")) != 0:
        follow(runner)
        return
    import uvicorn

    metrics = Metrics()
    engine = Engine(runner, payload["max_batch"], payload["kv_budget"], metrics, distributed=tp * pp > 1)
    limits = Limits(payload["name"], cfg.max_seq_len, cfg.vocab_size, payload["max_tokens"], payload["kv_budget"])
    app = Api(engine, limits, tok, metrics, payload["max_queue"]).app()
    sock = bind(payload["host"], payload["port"])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1))

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            engine.stopping.set()

    threading.Thread(target=http, name="plait-http", daemon=True).start()
    print(f"plait serve: {payload['name']} on http://{payload['host']}:{payload['port']}/v1 "
          f"(tp {tp}, pp {pp}, max batch {payload['max_batch']}, KV budget {payload['kv_budget']} positions)",
          flush=True)
    engine.run()
