"""Work items flowing through the pipeline chunks as a wavefront: tick order and deadlock-free activation hand-off."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait.errors import comm_wait

if TYPE_CHECKING:
    from plait.generation.decode import Decoder


def wavefront_order(chunks: list[int], groups: int, positions: int = 1,
                    stride: int | None = None) -> list[tuple[int, int, int]]:
    """(chunk, group, position) items of this rank's ``chunks``, sorted by tick = position * stride + group + chunk.

    Every rank sorts the same way, so an item only ever waits for items of strictly earlier ticks (the
    previous chunk at tick - 1; the tokens of the previous position at least one tick before when
    ``stride`` is large enough) and the stages work on different groups at the same time.
    """
    stride = stride if stride is not None else 0
    items = [(p * stride + g + c, c, g, p) for p in range(positions) for c in chunks for g in range(groups)]
    return [(c, g, p) for _tick, c, g, p in sorted(items)]


class Links:
    """Activations between consecutive chunks: kept when one rank holds both, else a tagged isend / blocking recv.

    Sends never block (so two ranks sending to each other cannot deadlock); ``wait`` finishes them, each a
    named wait as a receive is (a peer that stopped taking them is named by the sender too). The
    tag is the receiving chunk, and every rank visits its items in the same tick order, so messages of the
    same pair and tag are received in the order they were sent.
    """

    def __init__(self, dec: Decoder) -> None:
        self.dec, self.dim = dec, dec.hidden_size
        self.kept: dict[tuple, torch.Tensor] = {}
        self.pending: list[tuple[dist.Work, torch.Tensor, int, Callable[[], str]]] = []

    def take(self, c: int, key: tuple, b: int, s: int, what: Callable[[], str] | None = None) -> torch.Tensor:
        """Input hidden states [b, s, dim] of chunk ``c`` > 0 for work item ``key`` (``what()``: it in errors)."""
        if (c - 1, key) in self.kept:
            return self.kept.pop((c - 1, key))
        x = torch.empty(b, s, self.dim, dtype=self.dec.dtype, device=self.dec.device)
        self.recv(x, self.dec.peer(c - 1), c, what or (lambda: f"the hidden states of item {key} into chunk {c}"))
        return x

    def recv(self, x: torch.Tensor, src: int, tag: int, what: Callable[[], str]) -> None:
        """Receive ``x`` from global rank ``src`` (blocking); see ``waiting``."""
        waiting(self.dec, what, src, lambda: dist.recv(x, src=src, tag=tag))

    def give(self, c: int, key: tuple, x: torch.Tensor, what: Callable[[], str] | None = None) -> None:
        """Hand chunk ``c``'s output for ``key`` to chunk ``c + 1`` (``what()``: it in errors)."""
        if self.dec.rank_of(c + 1) == self.dec.me:
            self.kept[(c, key)] = x
        else:
            self.send(x, self.dec.peer(c + 1), c + 1,
                      what or (lambda: f"the hidden states of item {key} into chunk {c + 1}"))

    def send(self, x: torch.Tensor, dst: int, tag: int, what: Callable[[], str]) -> None:
        """Send ``x`` (``what()`` in words) to global rank ``dst`` without blocking; ``wait`` finishes it."""
        x = x.contiguous()
        self.pending = [item for item in self.pending if not item[0].is_completed()]  # keep only unfinished ones
        work = dist.isend(x, dst=dst, tag=tag)
        assert work is not None, "isend on the default group returns a Work"
        self.pending.append((work, x, dst, what))

    def wait(self) -> None:
        """Finish every send still in flight; a peer that does not take one within the timeout is named."""
        for work, _x, dst, what in self.pending:
            waiting(self.dec, _send_words(what, dst), None, work.wait)
        self.pending.clear()


def _send_words(what: Callable[[], str], dst: int) -> Callable[[], str]:
    """The words of a send of ``what()`` to global rank ``dst``, built only when called."""
    return lambda: f"the send of {what()} to global rank {dst}"


def waiting(dec: Decoder, what: str | Callable[[], str], peer: int | None, op: Callable[[], object]) -> None:
    """Run ``op``, this pipeline rank's blocking wait for ``what`` from global rank ``peer`` (None: ``what`` names
    the rank), through plait.errors.comm_wait: a timeout or failure names "generate: pipeline rank N", ``what``
    and ``peer``."""
    timeout_s = dec.ctx.timeout_s if dec.ctx is not None else 0.0
    comm_wait(op, what, peer, timeout_s, me=f"generate: pipeline rank {dec.me}")
