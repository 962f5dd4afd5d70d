"""The worker job of ``plait serve``: every rank loads its part; rank 0 runs the engine and the HTTP server,
logs each request, and stops cleanly on SIGINT or SIGTERM (the same way under every layout)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time

from plait.distributed.job_signals import SignalThread

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_S = 0.5  # a stop signal this soon after the first is the same one, delivered twice
HTTP_JOIN_S = 5.0  # after the engine stopped, how long the HTTP server gets to send the last responses
LOGGER = "plait.serve"


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


class StopSignals:
    """SIGINT and SIGTERM while serving, taken in a ``SignalThread`` on every rank: the launcher's SIGTERM that ends
    a failed job ends the rank soon whatever it waits on. On rank 0 the first one starts the drain (handed to the
    engine once there is one); a Ctrl-C in a terminal reaches every process of the job and the launcher forwards
    it too, so a repeat within ``REPEAT_S`` is the same one, and a later one ends the running requests at once.
    The other ranks stop with rank 0's stop step. Taken in that thread, a signal reaches rank 0's engine at once,
    even while the main thread is inside a long step or a collective that waits on a dead peer: /health then still
    says "stopping".
    """

    def __init__(self, leader: bool):
        self.leader = leader
        self.reason = ""
        self.first = 0.0
        self.now = False  # a second Ctrl-C: no more grace
        self.engine = None
        self.grace = 0.0
        self.thread = SignalThread(STOP_SIGNALS, self._note)

    def _note(self, signum: int, failed: bool) -> None:
        if not self.leader:
            return
        name = signal.Signals(signum).name
        if not self.reason:
            self.reason, self.first = name, time.monotonic()
            if self.engine is None and not failed:  # not the launcher's end of a failed job
                print(f"plait serve: {name}: stopping once the model has loaded", file=sys.stderr, flush=True)
        elif not self.now and time.monotonic() - self.first > REPEAT_S:
            self.now = True
            print(f"plait serve: {name} again: ending the running requests now", file=sys.stderr, flush=True)
        self.hand_over()

    def attach(self, engine, grace: float) -> None:
        self.engine, self.grace = engine, grace
        self.hand_over()

    def hand_over(self) -> None:
        if self.reason and self.engine is not None:
            self.engine.request_stop(self.reason, 0.0 if self.now else self.grace)

    def close(self) -> None:
        """Stop the signal thread (the handlers stay: a late Ctrl-C must not fail a rank that has finished)."""
        self.thread.close()


def access_logger(level: str, enabled: bool) -> logging.Logger | None:
    """The logger of plait serve's own lines (to stderr at ``level``); None when the request log is off."""
    log = logging.getLogger(LOGGER)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False
    return log if enabled else None


def leave_a_core() -> int:
    """Rank 0's intra-op threads: one fewer than it was given (at least one), returned.

    Its HTTP thread (and often the clients, on the same machine) needs a core while the engine's forward runs.
    With as many intra-op threads as cores, one of them is descheduled for it at times, and the others wait
    for it at the end of every parallel operation (OpenMP threads spin, then sleep, at that barrier), once
    per operation of the step.
    """
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads() - 1))
    return torch.get_num_threads()


def serve_job(payload: dict) -> None:
    """Worker entry of ``plait serve``: every rank loads its part; rank 0 also runs the HTTP server."""
    import torch.distributed as dist

    from plait.distributed.collectives import collective
    from plait.distributed.default_group import DEFAULT_TIMEOUT_S
    from plait.generation.job import dtype_named, load_model
    from plait.serve.engine import STALL_SHOWN_S, follow
    from plait.serve.runner import Runner

    tp, pp, block = payload["tp"], payload["pp"], payload["kv_block"]
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        leave_a_core()
    signals = StopSignals(leader=rank == 0)
    # rank 0 holds its port before the process group starts: Gloo's and the store's listeners take ports
    # from the kernel's ephemeral range, and a --port in that range could otherwise go to one of them
    sock = bind(payload["host"], payload["port"]) if rank == 0 else None
    model, tok, cfg = load_model(payload["model"], tp, pp, dtype=dtype_named(payload["dtype"]))
    blocks = -(-payload["kv_budget"] // block)  # the pool: whole blocks covering the budget
    runner = Runner(model, blocks, block)
    if sock is None:
        _step_limit(runner, payload["step_timeout"], 2 * STALL_SHOWN_S)
        follow(runner)
    else:
        _lead(payload, sock, runner, tok, cfg, blocks, signals)
    signals.close()  # after an error it watches on: the launcher's SIGTERM still ends this rank if its end waits
    if runner.ctx is not None:
        runner.ctx.set_timeout(DEFAULT_TIMEOUT_S)  # rank 0 may still be sending its last responses
        # the last collective: it fails at once where a peer has died. A rank that has finished waits for its
        # launcher's word to exit, and the SIGTERM with which the launcher stops the job after a death reached
        # it while it still ignored SIGTERM (serving); without this it would wait for the launcher's SIGKILL
        collective("barrier at the end of serving", None, dist.barrier)


def _step_limit(runner, seconds: float, more: float) -> dict[int, int]:
    """Once every rank has loaded its part (and rank 0 is about to run the engine), from then on a collective
    fails after waiting ``seconds`` (--step-timeout) and ``more``; every other rank's pid, by rank (rank 0 names
    a rank that does not answer by it).

    Rank 0 gives a stalled step ``STALL_SHOWN_S`` more (the time /health says "stalled" first), the others twice
    that: a rank that waits for rank 0's next step began waiting before rank 0's step began, and the launcher
    reports the first failure, which is to be rank 0's naming the rank it waited on."""
    import torch.distributed as dist

    from plait.distributed.collectives import collective

    pids: list = [None] * dist.get_world_size()
    collective("all-gather of the ranks' pids", None, lambda: dist.all_gather_object(pids, os.getpid()))
    runner.ctx.set_timeout(seconds + more)
    return {r: pid for r, pid in enumerate(pids) if r != dist.get_rank()}


def scheduler(payload: dict, cfg, blocks: int):
    """Rank 0's scheduler over a pool of ``blocks`` blocks for the model of config ``cfg``: it frees the blocks
    outside the window where every layer has one (``Scheduler``'s ``window``)."""
    from plait.models.window import every_layer_window
    from plait.serve.kv import BlockAllocator
    from plait.serve.scheduler import Scheduler

    alloc = BlockAllocator(blocks, payload["kv_block"], payload["prefix_cache"])
    return Scheduler(alloc, payload["max_batch"], payload["step_tokens"], payload["kv_reserve"],
                     every_layer_window(cfg.sliding_window, cfg.layer_types))


def _lead(payload: dict, sock: socket.socket, runner, tok, cfg, blocks: int, signals: StopSignals) -> None:
    """Rank 0: the engine in this (main) thread, uvicorn in another; after a stop, the last responses go out."""
    import uvicorn

    from plait.serve.engine import STALL_SHOWN_S, Engine
    from plait.serve.metrics import Metrics
    from plait.serve.protocol import Limits
    from plait.serve.server import Api
    from plait.serve.tokens import model_tokens

    tp, pp, block = payload["tp"], payload["pp"], payload["kv_block"]
    metrics = Metrics()
    sched = scheduler(payload, cfg, blocks)
    engine = Engine(runner, sched, tok, metrics, distributed=tp * pp > 1)
    tokens = model_tokens(payload["model"], tok, cfg.max_seq_len, payload["chat_template"],
                          payload["chat_template_kwargs"], payload["trust_request_chat_template"])
    limits = Limits(payload["name"], cfg.max_seq_len, cfg.vocab_size, payload["max_tokens"], payload["kv_budget"],
                    tokens.eos)
    api = Api(engine, limits, tokens, metrics, payload["max_queue"], payload["max_body"], payload["request_timeout"])
    level = payload["log_level"]
    app = api.app(payload["api_key"], access_logger(level, payload["access_log"]))
    server = uvicorn.Server(uvicorn.Config(app, log_level="debug" if level == "debug" else "warning",
                                           access_log=False, lifespan="off", timeout_graceful_shutdown=1))

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            engine.stopping.set()

    thread = threading.Thread(target=http, name="plait-http", daemon=True)
    thread.start()
    signals.attach(engine, payload["shutdown_timeout"])
    windowed = (f", blocks behind the sliding window of {sched.window} freed as sequences move on (at most "
                f"{sched.window_blocks} a sequence)") if sched.window else ""
    print(f"plait serve: {payload['name']} on http://{payload['host']}:{payload['port']}/v1 "
          f"(tp {tp}, pp {pp}, {str(runner.dec.dtype).removeprefix('torch.')} on {runner.dec.device}, "
          f"max batch {payload['max_batch']}, KV {blocks} blocks x {block} positions"
          f"{' reserved up front' if payload['kv_reserve'] else ''}"
          f"{', prefix caching' if payload['prefix_cache'] and not payload['kv_reserve'] else ''}"
          f"{windowed}, "
          f"{payload['step_tokens'] or 'unlimited'} tokens per step)\n"
          f"plait serve: chat template: {tokens.chat.source}"
          f"{f', variables {json.dumps(tokens.template_kwargs)}' if tokens.template_kwargs else ''}",
          flush=True)
    if runner.ctx is not None:
        engine.peers = _step_limit(runner, payload["step_timeout"], STALL_SHOWN_S)
        engine.step_limit = payload["step_timeout"]
    engine.run()
    server.should_exit = True
    thread.join(HTTP_JOIN_S)
    if signals.reason:
        print(f"plait serve: stopped ({signals.reason})", file=sys.stderr, flush=True)
