"""The OpenAI-compatible HTTP routes (FastAPI, run by uvicorn in a thread of rank 0: ``plait.serve.job``)."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from functools import partial
from typing import cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from plait.errors import is_integer
from plait.serve.access_log import AccessLog, Generation
from plait.serve.engine import Engine
from plait.serve.engine import Request as GenRequest
from plait.serve.handoff import Inbox, Mailbox
from plait.serve.metrics import Metrics
from plait.serve.protocol import ApiError, Limits, Parsed, check_messages, check_model, error_body, parse
from plait.serve.responses import Choice, envelope, new_id, usage
from plait.serve.tokens import TokenizerInfo

POLL_S = 0.1  # how often a handler checks whether its client went away, even while tokens flow


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class ApiKey:
    """ASGI middleware: every /v1 route needs "Authorization: Bearer <key>" (as vLLM's --api-key), else 401."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.key}".encode()):
                body = error_body("Incorrect API key provided (Authorization: Bearer <key>)", "invalid_request_error",
                                  code="invalid_api_key")
                await JSONResponse(body, 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _count(log: Generation, ev: dict, box: Mailbox) -> None:
    """The access log's count of a request's generated tokens and the time its first arrived."""
    if ev["type"] == "token":
        log.completion += 1
        log.first = box.first


class Api:
    """The routes, over an ``Engine`` (rank 0) that runs the requests."""

    def __init__(self, engine: Engine, limits: Limits, tokens: TokenizerInfo, metrics: Metrics, max_queue: int,
                 max_body: int = 16 << 20, timeout: float = 0.0):
        self.engine, self.limits, self.tokens, self.metrics = engine, limits, tokens, metrics
        self.tok = tokens.tok
        self.max_queue, self.max_body, self.timeout = max_queue, max_body, timeout
        self.created = int(time.time())
        self.inbox: Inbox | None = None

    def app(self, api_key: str | None = None, access_log: logging.Logger | None = None) -> FastAPI:
        """The application; ``access_log``: the logger of one line per request (none: no such lines)."""
        app = FastAPI(title="plait serve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(StarletteHTTPException, self._http_error)
        app.add_exception_handler(ApiError, self._api_error)
        app.add_exception_handler(Exception, self._server_error)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        app.get("/version")(self.version)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model_id:path}")(self.model)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.get("/tokenizer_info")(self.tokenizer_info)
        app.post("/v1/completions")(partial(self.generate, chat=False))
        app.post("/v1/chat/completions")(partial(self.generate, chat=True))
        if api_key:
            app.add_middleware(ApiKey, key=api_key)
        if access_log is not None:
            app.add_middleware(AccessLog, logger=access_log)  # the outermost: 401s are logged too
        return app

    # Starlette types every handler as taking an Exception; each is registered for the class it casts to
    async def _http_error(self, request: Request, exc: Exception) -> JSONResponse:
        http = cast(StarletteHTTPException, exc)
        kind = "invalid_request_error" if http.status_code < 500 else "server_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {http.detail}", kind), http.status_code)

    async def _api_error(self, request: Request, exc: Exception) -> JSONResponse:
        api = cast(ApiError, exc)
        return JSONResponse(api.body(), api.status)

    async def _server_error(self, request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500)

    async def _json(self, request: Request):
        """The request body as JSON, at most ``max_body`` bytes (else 413)."""
        declared = request.headers.get("content-length")
        too_big = ApiError(413, f"the request body exceeds {self.max_body} bytes", code="request_too_large")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise too_big
        data = bytearray()
        async for part in request.stream():
            data += part
            if len(data) > self.max_body:
                raise too_big
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None

    async def health(self) -> JSONResponse:
        if self.engine.stop_reason:
            return JSONResponse({"status": "stopping", "reason": self.engine.stop_reason}, 503)
        stalled = self.engine.stalled()  # also once the stalled step has failed: it never finished
        if stalled is not None:
            return JSONResponse({**stalled, "reason": self.engine.stall_message(stalled)}, 503)
        if self.engine.failed:
            return JSONResponse({"status": "failed", "reason": self.engine.failed}, 503)
        if not self.engine.ready.is_set():
            return JSONResponse({"status": "starting"}, 503)
        return JSONResponse({"status": "ok"})

    async def prometheus(self) -> PlainTextResponse:
        self.metrics.queue_depth = self.engine.queue_depth()
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def version(self) -> JSONResponse:
        from plait import __version__

        return JSONResponse({"version": __version__})

    def _card(self) -> dict:
        return {"id": self.limits.model, "object": "model", "created": self.created, "owned_by": "plait",
                "root": self.limits.model, "parent": None, "max_model_len": self.limits.context}

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, model_id: str) -> JSONResponse:
        if model_id != self.limits.model:
            raise ApiError(404, f"The model '{model_id}' does not exist; this server serves '{self.limits.model}'",
                           "model", "model_not_found")
        return JSONResponse(self._card())

    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's /tokenize: {"prompt"} or {"messages"}, add_special_tokens, return_token_strs (each id's string
        in the vocabulary, as transformers' convert_ids_to_tokens)."""
        body = await self._json(request)
        if not isinstance(body, dict) or not (isinstance(body.get("prompt"), str) or
                                              isinstance(body.get("messages"), list)):
            raise ApiError(400, "tokenize needs a prompt (a string) or messages (a list)", "prompt")
        check_model(body, self.limits)
        if "messages" in body:  # a chat template renders in a worker thread, as in ``generate``
            check_messages(body["messages"])
            ids = await run_in_threadpool(self.tokens.chat_ids, body)
        else:
            ids = self.tokens.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
        out = {"count": len(ids), "max_model_len": self.limits.context, "tokens": ids, "token_strs": None}
        if body.get("return_token_strs"):
            out["token_strs"] = [self.tok.token(t) for t in ids]  # vocabulary strings, special tokens too
        return JSONResponse(out)

    async def detokenize(self, request: Request) -> JSONResponse:
        body = await self._json(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(is_integer(t) and 0 <= t < self.limits.vocab for t in ids):
            raise ApiError(400, f"tokens must be a list of token ids in [0, {self.limits.vocab})", "tokens")
        return JSONResponse({"prompt": self.tok.decode(ids, skip_special_tokens=False)})  # /tokenize's inverse

    async def tokenizer_info(self) -> JSONResponse:
        return JSONResponse(self.tokens.info())

    async def generate(self, request: Request, chat: bool):
        try:
            # rendering a chat template (the folder's, or a trusted request's own code) and tokenizing run in a
            # worker thread: a slow template does not hold up the other requests' streams, /health or /metrics
            p = await run_in_threadpool(parse, await self._json(request), chat, self.tokens, self.limits)
            choices = p.choices()
            if self.engine.stop_reason:
                raise ApiError(503, f"the server is shutting down ({self.engine.stop_reason})", code="shutting_down")
            if self.engine.failed or not self.engine.ready.is_set():
                raise ApiError(503, "the engine is not running", code="engine_unavailable")
            if self.engine.queue_depth() + len(choices) > self.max_queue:
                raise ApiError(503, f"the server is overloaded ({self.max_queue} requests queued); retry later",
                               code="queue_full")
        except ApiError as exc:
            self.metrics.request("rejected")
            return JSONResponse(exc.body(), exc.status)
        rid = new_id(chat)
        request.state.generation = Generation(rid, sum(len(ids) for ids in p.prompts))
        loop = asyncio.get_running_loop()
        q, inbox = Mailbox(loop, eager=p.stream), self._inbox(loop)
        rids = [self.engine.submit(GenRequest(ids, params, partial(inbox.post, q, i), wake=inbox.wake, stop=p.stop,
                                              stop_ids=p.stop_ids, include_stop=p.include_stop))
                for i, (ids, params) in enumerate(choices)]
        state = [Choice(p, i, ids, self.tok) for i, (ids, _) in enumerate(choices)]
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else float("inf")
        args = (request, p, rid, rids, state, q, deadline)
        if p.stream:
            return StreamingResponse(self._stream(*args), media_type="text/event-stream")
        return await self._complete(*args)

    def _inbox(self, loop: asyncio.AbstractEventLoop) -> Inbox:
        """The ``Inbox`` of the event loop serving this request (one per loop; uvicorn runs one)."""
        if self.inbox is None or self.inbox.loop is not loop:
            self.inbox = Inbox(loop)
        return self.inbox

    async def _next(self, request: Request, q: Mailbox, deadline: float, watch: list[float]):
        """The next (index, event); None when the client has gone; "timeout" past the deadline.

        The connection is checked at least every POLL_S (``watch``: when it was last), also while events flow.
        """
        while True:
            now = time.monotonic()
            if now - watch[0] >= POLL_S:
                watch[0] = now
                if await request.is_disconnected():
                    return None
            left = deadline - now
            if left <= 0:
                return "timeout"
            if q.events:
                return q.events.popleft()
            if not await q.wait(min(POLL_S, left)):
                watch[0] = 0.0  # nothing came: look at the connection right away

    def _cancel(self, request: Request, rids: list[int], state: list[Choice]) -> None:
        """Cancel the choices still running; the access log learns how each ended (a client that left a stream
        is seen here first when the server, not the handler, noticed it)."""
        log: Generation = request.state.generation
        log.finish = [c.finish for c in state]
        if log.end is None and any(c.finish is None for c in state):
            log.end = "disconnected"
        for r, c in zip(rids, state, strict=True):
            if c.finish is None:
                self.engine.cancel(r)

    def _timed_out(self, log: Generation) -> dict:
        self.metrics.request("timeout")
        log.end = "timeout"
        return error_body(f"the request took longer than {self.timeout:g} s (--request-timeout)", "server_error",
                          code="request_timeout")

    async def _complete(self, request, p: Parsed, rid: str, rids, state: list[Choice], q: Mailbox,
                        deadline) -> Response:
        watch, log = [0.0], request.state.generation
        try:
            while any(c.finish is None for c in state):
                item = await self._next(request, q, deadline, watch)
                if item is None:
                    return Response(status_code=499)  # nobody is listening; the finally cancels
                if item == "timeout":
                    return JSONResponse(self._timed_out(log), 504)
                i, ev = item
                if ev["type"] == "error":
                    log.end = "error"
                    return JSONResponse(error_body(ev["message"], "server_error", code=ev.get("code")),
                                        ev.get("status", 500))
                _count(log, ev, q)
                state[i].feed(ev)
        finally:
            self._cancel(request, rids, state)
        body = envelope(p, rid, self.limits.model, [c.final() for c in state], chunk=False)
        return JSONResponse({**body, "usage": usage(p, sum(len(c.ids) for c in state))})

    async def _stream(self, request, p: Parsed, rid: str, rids, state: list[Choice], q: Mailbox, deadline):
        model = self.limits.model
        extra = {"usage": None} if p.include_usage else {}

        def so_far() -> dict:  # the usage field of a chunk: null, or the counts so far (continuous_usage_stats)
            return {"usage": usage(p, sum(len(c.ids) for c in state))} if p.continuous_usage else extra

        try:
            if p.chat:
                for c in state:
                    first = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}
                    yield _sse({**envelope(p, rid, model, [first], chunk=True), **so_far()})
            watch, log = [0.0], request.state.generation
            while any(c.finish is None for c in state):
                item = await self._next(request, q, deadline, watch)
                if item is None:
                    return
                if item == "timeout" or item[1]["type"] == "error":
                    error = (self._timed_out(log) if item == "timeout" else
                             error_body(item[1]["message"], "server_error", code=item[1].get("code")))
                    log.end, log.error = log.end or "error", error["error"]["message"]
                    yield _sse(error)
                    return
                i, ev = item
                _count(log, ev, q)
                part = state[i].feed(ev)
                if part is not None:
                    yield _sse({**envelope(p, rid, model, [part], chunk=True), **so_far()})
            if p.include_usage:
                total = usage(p, sum(len(c.ids) for c in state))
                yield _sse({**envelope(p, rid, model, [], chunk=True), "usage": total})
            yield "data: [DONE]\n\n"
        finally:
            self._cancel(request, rids, state)
