"""Rank 0's engine loop: schedules sequences, broadcasts each ``Step``, turns the outputs into events.

The HTTP thread only calls ``submit`` and ``cancel`` (a thread-safe queue). Between steps the loop takes
new and cancelled requests, asks the ``Scheduler`` which sequences run and with how many tokens, then
broadcasts the step to every rank with ``broadcast_object_list``; all ranks run it (``Runner.execute``) and
rank 0 turns each row's outputs into events for the request's sink: prompt log-probabilities, tokens with
their text (stop strings cut exactly), and the end with its reason.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch.distributed as dist

from plait.distributed.collectives import collective
from plait.distributed.job_signals import process_state
from plait.errors import CommTimeoutError, is_timeout
from plait.generation.text import TextTracker
from plait.serve.metrics import Metrics
from plait.serve.runner import Row, Runner, Step
from plait.serve.sampling import Params
from plait.serve.scheduler import Scheduler, Seq

HEARTBEAT_S = 1.0  # an idle engine still broadcasts (an empty step) this often: workers stay in step
NEXT_STEP = "broadcast of the next step from rank 0"  # the collective that starts every step, in words
STALL_SHOWN_S = 5.0  # /health says "stalled" this long before the stalled step's collective fails (the job ends)


class StepStalled(RuntimeError):
    """A step waited longer than the step limit for the other ranks (the message names them)."""


@dataclass(eq=False)
class Request:
    """One sequence to generate; ``sink(event)`` is called from the engine thread with the events of ``Engine``.

    ``wake``: called once after each step that gave the request events (requests sharing one ``wake`` get one
    call), so a consumer may hand a step's events over in one go instead of one at a time. ``stop_ids``:
    tokens that end the sequence (the end-of-sequence token unless ignored, and stop_token_ids), not part of
    its text; ``stop``: strings that end it, cut from the text unless ``include_stop``.
    """

    prompt: list[int]
    params: Params
    sink: Callable[[dict], None]
    stop: list[str] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    include_stop: bool = False
    rid: int = 0
    wake: Callable[[], None] | None = None
    arrived: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class Live:
    req: Request
    seq: Seq
    text: TextTracker


class Engine:
    """Continuous batching: the ``Scheduler`` decides each step, the ``Runner`` of every rank runs it.

    Events: {"type": "prompt", "logprobs": [(logprob, top)]} (echo, prompt positions 1, 2, ... in order),
    {"type": "token", "id", "text", "logprob": (logprob, [(id, logprob)]) or None},
    {"type": "done", "finish_reason": "stop" | "length", "text"}, {"type": "error", "message"} (with "status" 503
    and "code" when the server stopped before the request finished).

    ``request_stop`` (a signal handler's) drains: requests already running go on for up to ``grace`` seconds,
    then those left end with an error event, and the stop step ends every rank's loop.
    """

    def __init__(self, runner: Runner, scheduler: Scheduler, tok, metrics: Metrics, distributed: bool):
        self.runner, self.sched, self.tok, self.metrics, self.distributed = runner, scheduler, tok, metrics, distributed
        self.block = scheduler.alloc.block_size
        metrics.kv_budget = scheduler.alloc.num_blocks * self.block
        self.commands: queue.Queue = queue.Queue()
        self.ids = itertools.count(1)
        self.live: dict[int, Live] = {}
        self.to_free: list[int] = []
        self.woken: dict[Callable[[], None], None] = {}  # the ``wake`` of requests given events since the last step
        self.ready = threading.Event()
        self.failed: str | None = None
        self.stopping = threading.Event()  # stop now (the HTTP server is gone)
        self.stop_reason = ""  # why a drain was asked for ("SIGINT"); empty while serving
        self.drain_until = float("inf")
        self.last_broadcast = 0.0
        self.step_limit = float("inf")  # seconds a step may wait for the other ranks (``stalled``)
        self.peers: dict[int, int] = {}  # every other rank's pid, by rank
        self.steps = 0  # steps begun (an idle engine's empty ones too)
        self.step_size = (0, 0)  # the running step's rows and tokens
        self.step_began = 0.0  # when the running step began (monotonic); 0.0 between steps
        self.phase = ""  # what the running step is doing: its broadcast or its forward

    # --- called from the HTTP thread -------------------------------------------------------------------
    def submit(self, req: Request) -> int:
        req.rid = next(self.ids)
        self.commands.put(("submit", req))
        return req.rid

    def cancel(self, rid: int) -> None:
        self.commands.put(("cancel", rid))

    def queue_depth(self) -> int:
        return len(self.sched.waiting) + self.commands.qsize()

    def request_stop(self, reason: str, grace: float) -> None:
        """Stop after the running requests finish, ``grace`` seconds from now at most (a repeat may shorten
        it, not lengthen it; safe in a signal handler)."""
        self.drain_until = min(self.drain_until, time.monotonic() + grace)
        self.stop_reason = self.stop_reason or reason

    def stalled(self) -> dict | None:
        """None, or (once the running step has waited longer than ``step_limit``) what it waits on: the step, the
        seconds, and each other rank with what the kernel says it is doing. Safe from any thread."""
        began, phase, n = self.step_began, self.phase, self.steps
        waited = time.monotonic() - began
        if not began or waited < self.step_limit:
            return None
        ranks = {str(r): f"pid {pid}, {process_state(pid)}" for r, pid in sorted(self.peers.items())}
        return {"status": "stalled", "step": n, "rows": self.step_size[0], "tokens": self.step_size[1],
                "waiting_on": phase, "seconds": round(waited, 1),
                "step_timeout": self.step_limit, "ranks": ranks}

    def stall_message(self, info: dict) -> str:
        """One line from ``stalled``'s answer: the ranks that did not answer first (stopped, in uninterruptible
        sleep, gone), else every other rank (one of them did not answer)."""
        ranks = info["ranks"]
        stuck = {r: s for r, s in ranks.items() if not s.endswith(("running", "sleeping"))} or ranks
        named = ", ".join(f"rank {r} ({s})" for r, s in stuck.items())
        which = "did not answer" if len(stuck) == 1 or len(stuck) < len(ranks) else "did not all answer"
        rows = f"{info['rows']} row{'' if info['rows'] == 1 else 's'}"
        return (f"step {info['step']} ({rows}, {info['tokens']} tokens) waited {info['seconds']} s "
                f"(--step-timeout {info['step_timeout']:g}) in its {info['waiting_on']}: {named} {which}")

    def _began(self, phase: str, step: Step | None = None) -> None:
        """The running step moves on to ``phase``; a ``step`` given: it begins (with its broadcast)."""
        self.phase = phase
        if step is not None:
            self.steps += 1
            self.step_size = (len(step.rows), sum(len(r.tokens) for r in step.rows))
            self.step_began = time.monotonic()

    # --- the loop (rank 0's main thread) ---------------------------------------------------------------
    def run(self) -> None:
        """Plan, broadcast and run steps until ``stopping`` is set; every other rank runs ``follow``."""
        try:
            empty = Step()
            self._broadcast(empty)  # every rank has loaded its part once this returns
            self.runner.execute(empty)
            self.ready.set()
            while True:
                self._drain(block=not self.live)
                stop = self.stopping.is_set() or self._drained()
                step, pairs = self._plan(stop)
                if not step.busy and not stop and time.monotonic() - self.last_broadcast < HEARTBEAT_S:
                    self._wake()
                    continue
                self._began("broadcast", step)
                self._broadcast(step)
                self._began("forward (its collectives)")
                outputs = self.runner.execute(step)
                self.step_began = 0.0
                self._deliver(pairs, outputs or [])
                self._wake()
                if stop:
                    return
        except BaseException as exc:
            info = self.stalled()
            if info is None:
                self.failed = f"{type(exc).__name__}: {exc}"
                self._fail_all(self.failed)
                raise
            self.failed = f"StepStalled: {self.stall_message(info)}"
            self._fail_all(self.failed)
            raise StepStalled(f"{self.stall_message(info)} ({type(exc).__name__}: {exc})") from exc

    def _drained(self) -> bool:
        """True once a requested stop may happen: nothing runs, or the grace is over (the rest then fail)."""
        if not self.stop_reason or (self.live and time.monotonic() < self.drain_until):
            return False
        self._fail_all(f"the server stopped ({self.stop_reason}) before this request finished", 503, "shutting_down")
        return True

    def _broadcast(self, step: Step) -> None:
        self.last_broadcast = time.monotonic()
        if self.distributed:
            collective(NEXT_STEP, None, partial(dist.broadcast_object_list, [step], src=0))

    def _drain(self, block: bool) -> None:
        timeout = 0.05 if block else 0.0
        while True:
            try:
                kind, arg = self.commands.get(timeout=timeout) if timeout else self.commands.get_nowait()
            except queue.Empty:
                return
            timeout = 0.0
            if kind == "submit":
                self._admit(arg)
            else:
                self._cancel(arg)

    def _admit(self, req: Request) -> None:
        seq = Seq(req.rid, req.prompt, req.params)
        self.live[req.rid] = Live(req, seq, TextTracker(self.tok, req.stop, req.include_stop, req.prompt))
        if seq.max_tokens == 0 and req.params.prompt_logprobs is None:
            self._finish(req.rid, "length")
        else:
            self.sched.add(seq)

    def _cancel(self, rid: int) -> None:
        if rid in self.live:
            self._drop(rid)
            self.metrics.request("cancelled")

    def _drop(self, rid: int) -> None:
        live = self.live.pop(rid)
        self.sched.remove(live.seq)
        if live.seq.known:
            self.to_free.append(rid)

    def _plan(self, stop: bool) -> tuple[Step, list[tuple[Seq, int]]]:
        free, self.to_free = self.to_free, []
        if stop:
            return Step(free=free, stop=True), []
        pairs = self.sched.schedule()
        new, rows = [], []
        for seq, n in pairs:
            if not seq.known:
                new.append((seq.rid, seq.params))
                seq.known = True
            end = seq.computed + n
            sample = end == seq.length and len(seq.out) < seq.max_tokens
            rows.append(Row(seq.rid, seq.tokens(seq.computed, n), seq.computed, list(seq.table), sample,
                            self._targets(seq, n)))
        return Step(free=free, new=new, rows=rows), pairs

    @staticmethod
    def _targets(seq: Seq, n: int) -> list[int]:
        """Prompt tokens after the chunk's first positions whose log-probabilities are still owed (echo)."""
        if seq.params.prompt_logprobs is None:
            return []
        upto = min(n, len(seq.prompt) - 1 - seq.computed)  # chunk positions whose next token is a prompt token
        if upto <= 0 or seq.computed + upto < seq.reported:
            return []
        return seq.prompt[seq.computed + 1: seq.computed + 1 + upto]

    def _deliver(self, pairs: list[tuple[Seq, int]], outputs: list) -> None:
        now = time.monotonic()
        tokens = chunks = 0
        for (seq, n), (tok, lp, prompt_lp) in zip(pairs, outputs, strict=True):
            chunks += seq.computed < len(seq.prompt)
            live = self.live.get(seq.rid)
            if live is None:
                continue
            if prompt_lp:
                fresh = prompt_lp[seq.reported - seq.computed - 1:]
                seq.reported += len(fresh)
                self._emit(live.req, {"type": "prompt", "logprobs": fresh})
            seq.computed += n
            self.sched.computed(seq)
            if tok is None:
                if seq.computed == seq.length and seq.max_tokens == 0:
                    self._finish(seq.rid, "length")
                continue
            tokens += 1
            seq.out.append(tok)
            if len(seq.out) == 1:
                self.metrics.first_token(now - live.req.arrived)
            self._token(live, tok, lp)
        alloc = self.sched.alloc
        self.metrics.step(tokens, len(self.sched.running), len(self.sched.waiting), alloc.used * self.block,
                          sum(n for seq, n in pairs if n > 1), chunks, self.sched.preemptions, self.sched.cached_tokens,
                          self.sched.window_freed)

    def _token(self, live: Live, tok: int, lp) -> None:
        """Hand one new token to its request; end the sequence on a stop token, a stop string or max_tokens."""
        seq, req = live.seq, live.req
        check = len(seq.out) >= seq.params.min_tokens
        if tok in req.stop_ids and check:
            self._emit(req, {"type": "token", "id": tok, "text": "", "logprob": lp})
            self._finish(seq.rid, "stop")
            return
        self._emit(req, {"type": "token", "id": tok, "text": live.text.push(tok, check), "logprob": lp})
        if live.text.stopped is not None:
            self._finish(seq.rid, "stop")
        elif len(seq.out) >= seq.max_tokens:
            self._finish(seq.rid, "length")

    def _finish(self, rid: int, reason: str) -> None:
        live = self.live[rid]
        tail = live.text.flush()
        self._drop(rid)
        self.metrics.request("ok")
        self._emit(live.req, {"type": "done", "finish_reason": reason, "text": tail})

    def _fail_all(self, message: str, status: int = 500, code: str | None = None) -> None:
        """End every request, also those submitted but not yet taken, with an error event."""
        self._drain(block=False)
        if status == 500:
            message = f"the engine stopped: {message}"
        if self.live:
            self.metrics.request("shutdown" if code == "shutting_down" else "error", len(self.live))
        for live in self.live.values():
            self._emit(live.req, {"type": "error", "message": message, "status": status, "code": code})
        self.live.clear()
        self._wake()

    def _emit(self, req: Request, event: dict) -> None:
        req.sink(event)
        if req.wake is not None:
            self.woken[req.wake] = None

    def _wake(self) -> None:
        """Call each ``wake`` of the requests given events since the last call, once."""
        woken, self.woken = self.woken, {}
        for wake in woken:
            wake()


def follow(runner: Runner) -> None:
    """Every rank but 0: receive each step from rank 0 and run it, until a step says stop.

    A collective that times out (a rank did not answer within --step-timeout and twice ``STALL_SHOWN_S``)
    raises ``CommTimeoutError`` saying what this rank waited on; rank 0's ``StepStalled``, sooner, names the
    rank (``plait.serve.job``)."""
    try:
        while True:
            phase = "waiting for rank 0's next step"
            box: list = [None]
            collective(NEXT_STEP, None, partial(dist.broadcast_object_list, box, src=0))
            step: Step = box[0]
            phase = "in a step's forward (its collectives)"
            runner.execute(step)
            if step.stop:
                return
    except RuntimeError as exc:
        if not is_timeout(exc):
            raise
        raise CommTimeoutError(f"timed out {phase}: a rank did not answer ({exc})") from exc
