"""The engine thread's events handed to the HTTP handlers on the event loop: a step at a time, a handler woken only
when it has something to do."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

ENDS = ("done", "error")  # events that end a choice


class Mailbox:
    """One request's events on the event loop, in order; its handler takes them, waiting when there are none.

    ``eager`` (a stream, which sends every token on): a waiting handler is woken by each event. Otherwise (a
    whole completion) only an event that ends a choice wakes it, the tokens before it waiting in order: a
    completion's handler resumes once a choice, not once a token. ``first``: when the first token arrived
    (the access log's time to first token).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, eager: bool):
        self.loop, self.eager = loop, eager
        self.events: deque[tuple[int, dict]] = deque()
        self.waiter: asyncio.Future | None = None
        self.first: float | None = None
        self.wakes = 0  # times a waiting handler was woken by an event

    def put(self, index: int, event: dict) -> None:
        """On the loop: add ``(index, event)``, waking the handler if it waits for one like it."""
        self.events.append((index, event))
        if self.first is None and event["type"] == "token":
            self.first = time.monotonic()
        if self.waiter is not None and not self.waiter.done() and (self.eager or event["type"] in ENDS):
            self.waiter.set_result(None)
            self.wakes += 1

    async def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a waking event; whether any event is there now."""
        self.waiter = self.loop.create_future()
        try:
            await asyncio.wait_for(self.waiter, timeout)  # a future: no task is made for the wait
        except asyncio.TimeoutError:
            pass
        finally:
            self.waiter = None
        return bool(self.events)


class Inbox:
    """Events from the engine thread to the mailboxes on one event loop, handed over a step at a time.

    ``post`` (engine thread) only appends to a list; ``wake`` (the engine calls it once after a step that
    posted) asks the loop to ``_hand_over`` everything posted so far: one ``call_soon_threadsafe`` (a write
    to the loop's wake-up pipe, a GIL hand-over to the HTTP thread) a step for all its requests' events,
    not one an event. ``wakeups`` counts the wake-ups asked for.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list[tuple[Mailbox, int, dict]] = []
        self.asked = False  # a wake-up is on its way: a later ``wake`` need not ask again
        self.wakeups = 0

    def post(self, box: Mailbox, index: int, event: dict) -> None:
        """Engine thread: queue ``(index, event)`` for ``box``."""
        with self.lock:
            self.pending.append((box, index, event))

    def wake(self) -> None:
        """Engine thread: have the loop hand over what was posted."""
        with self.lock:
            if self.asked or not self.pending:
                return
            self.asked = True
            self.wakeups += 1
        try:
            self.loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the loop is gone (server shutting down)
            pass

    def _hand_over(self) -> None:
        with self.lock:
            batch, self.pending, self.asked = self.pending, [], False
        for box, index, event in batch:
            box.put(index, event)
