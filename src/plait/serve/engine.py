"""Rank 0's engine loop: admits queued requests into KV slots, plans each step, broadcasts it, streams tokens.

The HTTP thread only calls ``submit`` and ``cancel`` (a thread-safe queue). Between decode steps the loop
frees the slots of finished or cancelled requests, admits waiting requests while a slot and enough KV
budget (prompt + max_tokens positions) are free, then broadcasts the plan to every rank with
``broadcast_object_list``; all ranks run it (``Runner.execute``) and rank 0 hands each request its token.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from plait.generation.decode import Sampling
from plait.serve.metrics import Metrics
from plait.serve.runner import Decode, Prefill, Runner, Step

HEARTBEAT_S = 1.0  # an idle engine still broadcasts (an empty plan) this often: workers stay in step


@dataclass
class Request:
    """One sequence to generate; ``sink(event)`` is called from the engine thread with token/done/error events."""

    prompt: list[int]
    sampling: Sampling
    sink: Callable[[dict], None]
    rid: int = 0
    slot: int = -1
    out: list[int] = field(default_factory=list)
    arrived: float = field(default_factory=time.monotonic)

    @property
    def need(self) -> int:
        """KV positions this request may use: its prompt plus every token it may generate."""
        return len(self.prompt) + self.sampling.max_new_tokens


class Engine:
    """Continuous batching over ``max_batch`` KV slots and a budget of ``kv_budget`` cached positions."""

    def __init__(self, runner: Runner, max_batch: int, kv_budget: int, metrics: Metrics, distributed: bool):
        self.runner, self.max_batch, self.kv_budget = runner, max_batch, kv_budget
        self.metrics, self.distributed = metrics, distributed
        metrics.kv_budget = kv_budget
        self.commands: queue.Queue = queue.Queue()
        self.ids = itertools.count(1)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self.free_slots = list(range(max_batch))
        self.to_free: list[int] = []
        self.kv_used = 0
        self.ready = threading.Event()
        self.failed: str | None = None
        self.stopping = threading.Event()
        self.last_broadcast = 0.0

    # --- called from the HTTP thread -------------------------------------------------------------------
    def submit(self, req: Request) -> int:
        req.rid = next(self.ids)
        self.commands.put(("submit", req))
        return req.rid

    def cancel(self, rid: int) -> None:
        self.commands.put(("cancel", rid))

    def queue_depth(self) -> int:
        return len(self.waiting) + self.commands.qsize()

    # --- the loop (rank 0's main thread) ---------------------------------------------------------------
    def run(self) -> None:
        """Plan, broadcast and run steps until ``stopping`` is set; every other rank runs ``follow``."""
        try:
            empty = Step()
            self._broadcast(empty)  # every rank has loaded its part once this returns
            self.runner.execute(empty)
            self.ready.set()
            while True:
                self._drain(block=not (self.running or self.waiting))
                stop = self.stopping.is_set()
                step = self._plan(stop)
                if not step.busy and not stop and time.monotonic() - self.last_broadcast < HEARTBEAT_S:
                    continue
                self._broadcast(step)
                tokens = self.runner.execute(step)
                self._deliver(step, tokens)
                if stop:
                    return
        except BaseException as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            self._fail_all(self.failed)
            raise

    def _broadcast(self, step: Step) -> None:
        self.last_broadcast = time.monotonic()
        if self.distributed:
            dist.broadcast_object_list([step], src=0)

    def _drain(self, block: bool) -> None:
        timeout = 0.05 if block else 0.0
        while True:
            try:
                kind, arg = self.commands.get(timeout=timeout) if timeout else self.commands.get_nowait()
            except queue.Empty:
                return
            timeout = 0.0
            if kind == "submit":
                if arg.sampling.max_new_tokens == 0:
                    self._finish(arg)
                else:
                    self.waiting.append(arg)
            else:
                self._cancel(arg)

    def _cancel(self, rid: int) -> None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self.metrics.request("cancelled")
                return
        for slot, req in list(self.running.items()):
            if req.rid == rid:
                self._release(slot)
                self.metrics.request("cancelled")
                return

    def _release(self, slot: int) -> None:
        req = self.running.pop(slot)
        self.kv_used -= req.need
        self.to_free.append(slot)

    def _plan(self, stop: bool) -> Step:
        free, self.to_free = self.to_free, []
        self.free_slots.extend(free)
        prefill = []
        while not stop and self.waiting and self.free_slots and self.kv_used + self.waiting[0].need <= self.kv_budget:
            req = self.waiting.popleft()
            req.slot = self.free_slots.pop(0)
            self.running[req.slot] = req
            self.kv_used += req.need
            prefill.append(Prefill(req.slot, req.prompt, req.sampling))
        fresh = {p.slot for p in prefill}
        decode = [] if stop else [Decode(slot, r.out[-1]) for slot, r in self.running.items() if slot not in fresh]
        return Step(free=free, prefill=prefill, decode=decode, stop=stop)

    def _deliver(self, step: Step, tokens: list[int]) -> None:
        slots = [slot for group, _ in self.runner.groups(step) for slot in group]  # the rows in group order
        now = time.monotonic()
        for slot, tok in zip(slots, tokens, strict=True):
            req = self.running[slot]
            req.out.append(tok)
            if len(req.out) == 1:
                self.metrics.first_token(now - req.arrived)
            req.sink({"type": "token", "id": tok})
            if len(req.out) >= req.sampling.max_new_tokens:
                self._release(slot)
                self._finish(req)
        prompt_tokens = sum(len(p.prompt) for p in step.prefill)
        self.metrics.step(len(tokens), len(self.running), len(self.waiting), self.kv_used, prompt_tokens)

    def _finish(self, req: Request) -> None:
        self.metrics.request("ok")
        req.sink({"type": "done", "finish_reason": "length"})

    def _fail_all(self, message: str) -> None:
        for req in [*self.waiting, *self.running.values()]:
            req.sink({"type": "error", "message": f"the engine stopped: {message}"})
        self.waiting.clear()
        self.running.clear()


def follow(runner: Runner) -> None:
    """Every rank but 0: receive each step's plan from rank 0 and run it, until a plan says stop."""
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        step: Step = box[0]
        runner.execute(step)
        if step.stop:
            return
