"""Autoregressive decoding with per-rank KV caches under any TP x PP layout, pipelined over groups of prompts."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from plait.distributed.context import ParallelContext
from plait.distributed.same_batch import check_same_batch
from plait.errors import ConfigError, FieldError, is_integer, is_number, plain_numbers
from plait.models.registry import family_of
from plait.tensor_parallel.loss import full_logits

if TYPE_CHECKING:
    from plait.generation.text import TextTracker
    from plait.parallel_model import ParallelModel


@dataclass
class Sampling:
    """Greedy when ``temperature == 0``; otherwise softmax(logits / T) restricted to the ``top_k`` best if > 0,
    then to the smallest set whose probability reaches ``top_p`` (nucleus; Holtzman et al. 2020) if < 1,
    then to tokens at least ``min_p`` times as likely as the best one if > 0."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        plain_numbers(self)

    def check(self) -> None:
        for name in ("max_new_tokens", "top_k"):
            if not is_integer(getattr(self, name)):
                raise FieldError(name, getattr(self, name), "must be an integer >= 0")
        if not is_number(self.temperature):  # NaN or an infinity: no distribution to sample from
            raise FieldError("temperature", self.temperature, "must be a number >= 0")
        for name in ("max_new_tokens", "temperature", "top_k"):
            if getattr(self, name) < 0:
                raise FieldError(name, getattr(self, name), "must be >= 0")
        if not (0 < self.top_p <= 1 and 0 <= self.min_p <= 1):
            raise ConfigError(f"top_p={self.top_p} must be within (0, 1] and min_p={self.min_p} within [0, 1]")


def sample(logits: torch.Tensor, s: Sampling, gen: torch.Generator) -> torch.Tensor:
    """Next tokens [B] from last-position logits [B, V] (float64 for layout-independent ties)."""
    logits = logits.double()
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if s.top_k > 0:
        kth = logits.topk(min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        drop = ordered.cumsum(-1) - ordered >= s.top_p  # the mass before a token already reaches top_p
        probs = probs.scatter(-1, order, ordered.masked_fill(drop, 0.0))
    if s.min_p > 0:
        probs = probs.masked_fill(probs < s.min_p * probs.max(-1, keepdim=True).values, 0.0)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


class Decoder:
    """This rank's blocks of a (possibly parallel) language model, run chunk by chunk with KV caches.

    Which blocks keep a cache, and the width of what flows between stages, come from the model's family
    adapter (plait.models.family); the caches themselves belong to the caller (one dict per sequence group).
    """

    def __init__(self, model: nn.Module | ParallelModel):
        from plait.parallel_model import ParallelModel

        if isinstance(model, ParallelModel):
            model.ctx.check_open()  # closed: every rank refuses here, before the decode's first collective
            if model.ctx.cp_size > 1:
                raise ConfigError(f"generate with cp={model.ctx.cp_size}: decoding runs on whole sequences; load "
                                  "the model (or its checkpoint) under a layout with cp=1 to generate")
            self.ctx: ParallelContext | None = model.ctx
            family, config, vocab = model.family, model.model_config, model.vocab_size
            self.chunks = {c: list(zip(ch.names, ch.blocks, strict=True)) for c, ch in model.chunks.items()}
            self.num_chunks = model.schedule.num_stages
            self.rank_of: Callable[[int], int] = model.schedule.stage_to_rank
            self.device = model.ctx.device
            self.dtype = next(model.parameters()).dtype
        else:
            family, config = family_of(model), getattr(model, "config", None)
            self.ctx, vocab = None, family.vocab_size(config)
            self.chunks = {0: family.blocks(model).named}
            self.num_chunks, self.rank_of = 1, lambda c: 0
            p = next(model.parameters())
            self.device, self.dtype = p.device, p.dtype
        if family.loss != "next_token" or vocab is None:
            raise ConfigError(f"generate needs a language model (a next-token family such as Llama), not "
                              f"{family.name} models")
        self.vocab: int = vocab
        self.hidden_size = family.hidden_size(config)
        self.kv_names = [name for blocks in self.chunks.values() for name, _ in blocks if family.kv_layer(name)]
        self.family = family

    @property
    def me(self) -> int:
        """This rank's pipeline rank (0 without pipeline parallelism)."""
        return self.ctx.pp_rank if self.ctx is not None else 0

    def new_caches(self, make: Callable[[], Any] | None = None) -> dict[str, Any]:
        """One fresh cache per KV layer this rank holds (``make()`` builds one; by default the family's)."""
        return {name: (make or self.family.kv_cache)() for name in self.kv_names}

    def run(self, c: int, x: torch.Tensor, caches: dict[str, Any]) -> torch.Tensor:
        """Chunk ``c``'s blocks on ``x`` (token ids into chunk 0, hidden states [B, S, H] after), with ``caches``."""
        for name, block in self.chunks[c]:
            x = block(x, cache=caches[name]) if name in caches else block(x)
        return x

    def peer(self, c: int) -> int:
        """Global rank holding chunk ``c`` with this rank's tp/dp coordinates."""
        assert self.ctx is not None, "a plain model has no peers"
        return self.ctx.pp_peer(self.rank_of(c))

    def full_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the last position of the last chunk's output: [B, V] (gathered over TP)."""
        return full_logits(x[:, -1], self.ctx, self.vocab)


def context_length(model: object) -> int | None:
    """The longest sequence ``model`` (a plain model or a ParallelModel) was built for, if it says."""
    config = getattr(model, "model_config", None) or getattr(model, "config", None)  # ParallelModel, plain model
    return getattr(config, "max_seq_len", None)


#: check_same_batch's words for the prompts of plait.generate
PROMPTS = ("prompts", ("prompt ids", "lengths and sampling settings"), "every rank of a replica (its tp and pipeline "
           "ranks) passes plait.generate the same prompts and settings; replicas may differ")


def generate_ids(model: nn.Module | ParallelModel, prompts: list[list[int]], s: Sampling,
                 max_seq_len: int | None = None, trace: list | None = None,
                 stop_ids: Collection[int] = (), texts: list[TextTracker] | None = None) -> list[list[int]]:
    """New token ids for each prompt (the same on every rank). Prompts may differ in length.

    A continuation ends before its first token in ``stop_ids`` (the stop token is not part of it), or (``texts``:
    one TextTracker per prompt, fed each new token) after the token whose text completes one of its tracker's stop
    strings (that token is part of it; the tracker's ``text`` and ``stopped`` say where the string begins), else
    after ``s.max_new_tokens`` tokens; decoding ends once every continuation has ended. ``trace``, if given,
    receives ``(chunk, group, position, start, end)`` for every work item this rank ran, in order:
    ``time.monotonic`` once its inputs have arrived and after its output was handed on.
    """
    s.check()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token")
    lengths = [len(p) for p in prompts]
    total = max(lengths) + s.max_new_tokens
    max_seq_len = context_length(model) if max_seq_len is None else max_seq_len
    if max_seq_len is not None and total > max_seq_len:  # checked on every rank, before any collective
        raise ConfigError(f"prompt + max_new_tokens = {total} exceeds the model's max_seq_len {max_seq_len}")
    dec = Decoder(model)  # checks the model (no collective)
    ids = [t for p in prompts for t in p]
    if min(ids) < 0 or max(ids) >= dec.vocab:
        raise ConfigError(f"prompt token ids must lie in the model's vocabulary [0, {dec.vocab}); got ids from "
                          f"{min(ids)} to {max(ids)} (a string prompt: the tokenizer's ids must fit the model)")
    if dec.ctx is not None:  # every rank of a replica decodes the same prompts, or each would answer another's
        settings = [*lengths, s.max_new_tokens, s.temperature, s.top_k, s.seed, *sorted(stop_ids),
                    *(zlib.crc32("\0".join(t.stops).encode()) for t in texts or [])]  # each row's stop strings
        check_same_batch(dec.ctx, torch.tensor(ids), torch.tensor(settings, dtype=torch.float64), PROMPTS)
    buf = torch.zeros(len(prompts), total, dtype=torch.long)
    is_prompt = torch.zeros_like(buf, dtype=torch.bool)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        is_prompt[i, : len(p)] = True
    if texts is not None and len(texts) != len(prompts):
        raise ConfigError(f"texts: {len(texts)} trackers for {len(prompts)} prompts; give one per prompt")
    stop = frozenset(int(t) for t in stop_ids)
    stops = _Stops(stop, is_prompt, torch.tensor(lengths) + s.max_new_tokens - 1, texts)  # [B] last columns
    if total > min(lengths):
        _Pipelined(dec, buf, is_prompt, s, min(lengths), trace, stops).run()
    rows = [buf[i, n: int(stops.ends[i]) + 1].tolist() for i, n in enumerate(lengths)]
    return [row[: next((k for k, t in enumerate(row) if t in stop), len(row))] for row in rows]


class _Stops:
    """Which rows of the batch have ended: a stop token among their new tokens, a stop string in their text (each
    row's TextTracker of ``texts``), or their last column reached."""

    def __init__(self, stop: frozenset[int], is_prompt: torch.Tensor, ends: torch.Tensor,
                 texts: list[TextTracker] | None = None) -> None:
        self.ids = torch.tensor(sorted(stop), dtype=torch.long)
        self.is_prompt, self.ends, self.texts = is_prompt, ends, texts
        self.stopped = torch.zeros(len(ends), dtype=torch.bool)  # [B] a stop token among the new tokens

    def see(self, rows: torch.Tensor, col: int, tokens: torch.Tensor) -> None:
        """Column ``col`` of ``rows`` holds ``tokens`` (prompt tokens never stop a row). A row whose text now holds
        a stop string ends at ``col``: its last column."""
        new = ~self.is_prompt[rows, col]
        self.stopped[rows] |= torch.isin(tokens, self.ids) & new
        if self.texts is None:
            return
        for row, token, fresh in zip(rows.tolist(), tokens.tolist(), new.tolist(), strict=True):
            tracker = self.texts[row]  # every rank feeds it the same tokens in the same order: the same decisions
            if fresh and not self.stopped[row] and col <= self.ends[row] and tracker.stopped is None:
                tracker.push(int(token))
                if tracker.stopped is not None:
                    self.ends[row] = col

    def ended(self, rows: torch.Tensor, col: int) -> bool:
        """Whether every row of ``rows`` needs no column after ``col`` (all columns up to ``col`` seen)."""
        return bool((self.stopped[rows] | (self.ends[rows] <= col)).all())


class _Pipelined:
    """The decode loop as work items (chunk, group, position) in wavefront order over up to ``pp`` row groups.

    Position 0 prefills the common prefix of the prompts, position ``p`` > 0 feeds column ``start + p - 1``;
    each produces column ``start + p`` on the last stage, which sends a group's new tokens to every other
    stage. Greedy tokens of a group depend only on its rows, so group ``g`` starts its next position as soon
    as its token is known (stride ``max(groups, chunks)`` ticks per position: every stage busy). Sampled
    tokens are drawn for all rows at once, in row order, from the one seeded generator, as on one device,
    so a position waits for the last group of the previous one (stride ``groups + chunks - 1``).

    Stopping: before its first item of position ``p`` of group ``g``, every rank holds the tokens of position
    ``p - 1`` of ``g``'s stop unit (the group when greedy, every group when sampled: its rows share one
    stream of random numbers, so they stop together) and skips the unit's items from there on once all its
    rows have ended. Every rank decides from the same tokens, so no rank waits for an item another skipped;
    a row that ended keeps its group's batch shape (and so its neighbours' numerics) until the group stops.
    """

    def __init__(self, dec: Decoder, buf: torch.Tensor, is_prompt: torch.Tensor, s: Sampling, start: int,
                 trace: list | None, stops: _Stops) -> None:
        from plait.generation.wavefront import Links

        self.dec, self.buf, self.is_prompt, self.s, self.start, self.trace = dec, buf, is_prompt, s, start, trace
        pp = dec.ctx.pp_size if dec.ctx is not None else 1
        self.rows = list(torch.arange(buf.shape[0]).tensor_split(min(pp, buf.shape[0])))
        self.positions = buf.shape[1] - start
        self.last = dec.num_chunks - 1
        groups, chunks = len(self.rows), dec.num_chunks
        self.stride = max(groups, chunks) if s.temperature == 0 else groups + chunks - 1
        self.caches = [dec.new_caches() for _ in self.rows]
        self.gen = torch.Generator().manual_seed(s.seed)
        self.logits: dict[int, torch.Tensor] = {}
        self.links = Links(dec)
        self.stops = stops
        self.known = [-1] * groups  # per group: the last position whose tokens this rank holds
        self.ended: set[int] = set()  # groups with no items left
        self.sampler = dec.rank_of(self.last) == dec.me
        others = sorted({dec.rank_of(c) for c in range(chunks)} - {dec.me}) if self.sampler else []
        self.others = [dec.ctx.pp_peer(r) for r in others] if dec.ctx is not None else []

    @torch.no_grad()
    def run(self) -> None:
        from plait.generation.wavefront import wavefront_order

        dec = self.dec
        for c, g, p in wavefront_order(sorted(dec.chunks), len(self.rows), self.positions, self.stride):
            if p > 0 and not self._going(g, p):
                continue
            x = self._input(c, g, p)
            t0 = time.monotonic()
            x = dec.run(c, x, self.caches[g])
            if c == self.last:
                self._done(g, p, x)
            else:
                self.links.give(c, (g, p), x, self._hidden_states(c + 1, g, p))
            if self.trace is not None:
                self.trace.append((c, g, p, t0, time.monotonic()))
        self.links.wait()
        if dec.ctx is not None and dec.ctx.pp_size > 1:
            from plait.generation.wavefront import waiting

            out, src, group = self.buf.to(dec.device), dec.peer(self.last), dec.ctx.pp_group
            waiting(dec, "every prompt's tokens (the last stage's broadcast)", src,
                    lambda: dist.broadcast(out, src=src, group=group))
            self.buf.copy_(out.cpu())

    def _going(self, g: int, p: int) -> bool:
        """Whether group ``g`` still runs position ``p``: its stop unit's tokens of position ``p - 1`` are here
        (received from the last stage, which sent them before any item of position ``p``) and a row goes on."""
        if g in self.ended:
            return False
        unit = [g] if self.s.temperature == 0 else list(range(len(self.rows)))
        for h in unit:
            if self.known[h] < p - 1:
                self._receive(h, p - 1)
        col = self.start + p - 1
        if all(self.stops.ended(self.rows[h], col) for h in unit):
            self.ended.update(unit)
            return False
        return True

    def _receive(self, g: int, p: int) -> None:
        """Tokens of group ``g`` at position ``p`` from the last stage."""
        dec, rows = self.dec, self.rows[g]
        assert not self.sampler, "the last stage holds the tokens it sampled"
        got = torch.empty(len(rows), dtype=torch.long, device=dec.device)
        self.links.recv(got, dec.peer(self.last), dec.num_chunks, lambda: f"the tokens of {self._item(g, p)}")
        self._know(g, p, got.cpu())

    def _item(self, g: int, p: int) -> str:
        """Group ``g`` at position ``p`` in words: "prompts 0-3 at new position 2" (position 0: the prompt)."""
        rows = self.rows[g].tolist()
        which = f"prompt {rows[0]}" if len(rows) == 1 else f"prompts {rows[0]}-{rows[-1]}"
        return f"{which} at new position {p}"

    def _hidden_states(self, c: int, g: int, p: int) -> Callable[[], str]:
        """The words of group ``g``'s hidden states at position ``p`` into chunk ``c``, built only when called."""
        return lambda: f"the hidden states of {self._item(g, p)} into chunk {c}"

    def _know(self, g: int, p: int, tokens: torch.Tensor) -> None:
        rows, col = self.rows[g], self.start + p
        self.buf[rows, col] = tokens
        self.stops.see(rows, col, tokens)
        self.known[g] = p

    def _input(self, c: int, g: int, p: int) -> torch.Tensor:
        """Token ids (chunk 0) or hidden states of group ``g`` at position ``p``."""
        rows, dec = self.rows[g], self.dec
        if c > 0:
            return self.links.take(c, (g, p), len(rows), self.start if p == 0 else 1, self._hidden_states(c, g, p))
        if p == 0:
            return self.buf[rows, : self.start].to(dec.device)
        col = self.start + p - 1
        return self.buf[rows, col: col + 1].to(dec.device)

    def _done(self, g: int, p: int, x: torch.Tensor) -> None:
        """Last stage: sample column ``start + p`` of group ``g`` (of every group when sampling, after the last)."""
        last = self.dec.full_logits(x)  # [b, V]
        if self.s.temperature == 0:
            self._put(g, p, sample(last, self.s, self.gen).cpu())
            return
        self.logits[g] = last
        if g == len(self.rows) - 1:
            nxt = sample(torch.cat([self.logits.pop(i) for i in range(len(self.rows))]), self.s, self.gen).cpu()
            for i, rows in enumerate(self.rows):
                self._put(i, p, nxt[rows])

    def _put(self, g: int, p: int, nxt: torch.Tensor) -> None:
        """Store group ``g``'s tokens (rows still in their prompt keep it); send them to the other stages."""
        rows, col = self.rows[g], self.start + p
        self._know(g, p, torch.where(self.is_prompt[rows, col], self.buf[rows, col], nxt))
        if p + 1 < self.positions:
            tokens = self.buf[rows, col].to(self.dec.device)
            for dst in self.others:
                self.links.send(tokens, dst, self.dec.num_chunks, lambda: f"the tokens of {self._item(g, p)}")
