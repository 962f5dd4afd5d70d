"""Rank 0's scheduling policy: which sequences run in a step, how many tokens each, their KV blocks, preemption.

Chunked prefill (as in Sarathi, Agrawal et al. 2023, and vLLM): a step processes at most ``step_tokens``
tokens; every running sequence that decodes gets its one token first, then prompts are prefilled in chunks
with what is left, so a long prompt does not stall the decodes of everyone else, and a burst of arrivals
is spread over several steps. KV blocks are taken as the tokens arrive; a sequence is admitted only when
the blocks its whole prompt will need are free (beside a 1% watermark kept for decodes), so admitted
prompts do not push each other out. (A prompt cut by the budget takes the whole budget, so no admission
happens before its next chunk, which comes first in the next step.) When decoding
sequences find no free block, the sequence admitted last is preempted: its blocks are freed and it waits
at the head of the queue, to be recomputed (its prompt and the tokens it already generated prefilled again).

With prefix caching (``BlockAllocator(prefix_cache=True)``) a sequence admitted after another that began with
the same tokens starts from the cached blocks of that prefix: only the rest is prefilled (a preempted
sequence finds its own blocks again if they were not evicted meanwhile). At least the last prompt token is
always fed, since its logits give the first new token. Sequences whose sampling reads every prompt position
on the last stage (prompt log-probabilities, the repetition penalty) publish their blocks but start from 0.

A model whose every layer attends through a sliding window of W keys (``window``) frees a sequence's blocks as it
moves on: after a step, the blocks wholly before position ``computed - W + 1`` (the first key its next query sees)
go back to the pool (``BlockAllocator.drop``). The pool's blocks hold every layer's keys and values of their
positions, so a model with one full-attention layer (Qwen's ``max_window_layers``) keeps them all. Such a
sequence is fed at most W tokens a step, so it holds at most ``window_blocks`` blocks however long it runs, and
its admission counts no more (a long generation holds O(W) positions, and one preempted is recomputed in chunks
that fit).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from plait.serve.kv import BlockAllocator
from plait.serve.sampling import Params


@dataclass(eq=False)
class Seq:
    """One sequence (a request's choice) on rank 0: its tokens, how many are in the KV cache, its block table."""

    rid: int
    prompt: list[int]
    params: Params
    out: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose keys and values are cached
    table: list[int] = field(default_factory=list)
    reported: int = 1  # prompt positions whose log-probability was delivered (position 0 has none)
    known: bool = False  # the runners hold its Params
    order: int = 0  # admission order: the sequence admitted last is preempted first
    keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks (BlockAllocator.chain)
    published: int = 0  # leading blocks of its table already published (or taken from the cache)
    dropped: int = 0  # leading blocks of its table let go of (outside every layer's window)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.out)

    @property
    def max_tokens(self) -> int:
        return self.params.sampling.max_new_tokens

    @property
    def reuses_prefix(self) -> bool:
        """Whether it may start from cached blocks: the last stage needs none of its prompt positions."""
        return self.params.prompt_logprobs is None and self.params.repetition_penalty == 1.0

    def tokens(self, start: int, n: int) -> list[int]:
        """Tokens [start, start + n) of prompt + output."""
        p = len(self.prompt)
        return (self.prompt[start: start + n] if start + n <= p else
                self.prompt[start:] + self.out[max(start - p, 0): start + n - p])


class Scheduler:
    """Continuous batching over at most ``max_batch`` sequences, a token budget per step and a pool of KV blocks.

    ``step_tokens`` 0: no budget (every admitted prompt is prefilled whole in one step). ``reserve``: the
    policy without paging, each sequence holding blocks for prompt + max_tokens from its admission, which
    never preempts but admits fewer sequences. ``window``: the keys a query of every layer sees at most (None:
    some layer sees every earlier key), whose blocks are freed as sequences move past them.
    """

    def __init__(self, alloc: BlockAllocator, max_batch: int, step_tokens: int = 0, reserve: bool = False,
                 window: int | None = None):
        self.alloc, self.max_batch, self.step_tokens, self.reserve = alloc, max_batch, step_tokens, reserve
        self.window = window
        self.window_freed = 0  # blocks let go of before their sequence ended (outside every layer's window)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.orders = itertools.count()
        self.preemptions = 0
        self.cached_tokens = 0  # prompt tokens served from the prefix cache instead of being prefilled

    @property
    def window_blocks(self) -> int | None:
        """The most blocks a sequence holds at once under ``window`` (a step of at most W tokens after the W - 1
        positions its first query sees, one block more where they straddle a block's start); None without."""
        return None if self.window is None else self.alloc.blocks_for(2 * self.window - 1) + 1

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Seq) -> None:
        """Forget a finished or cancelled sequence, freeing its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.alloc.release(seq.table)

    def schedule(self) -> list[tuple[Seq, int]]:
        """The step's (sequence, tokens to feed) pairs, in order: decodes first, then prompt chunks, then admissions."""
        budget = self.step_tokens if self.step_tokens > 0 else float("inf")
        most = self.window or float("inf")  # tokens a sequence is fed in one step
        plan: list[tuple[Seq, int]] = []
        preempted = False
        for seq in sorted(self.running, key=lambda s: (s.length - s.computed > 1, s.order)):
            if seq not in self.running:  # preempted by an earlier one this step
                continue
            n = int(min(seq.length - seq.computed, budget, most))
            if n <= 0:
                continue
            while not self.alloc.grow(seq.table, seq.computed + n):
                victim = max(self.running, key=lambda s: s.order)
                self._preempt(victim)
                preempted = True
                budget += sum(m for s, m in plan if s is victim)
                plan = [(s, m) for s, m in plan if s is not victim]
                if victim is seq:
                    break
            else:
                plan.append((seq, n))
                budget -= n
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            hits = self._cached(seq)
            if not self._fits(seq, hits):
                break
            self.alloc.share(seq.table, hits)
            seq.computed = len(hits) * self.alloc.block_size
            seq.published = len(hits)
            self.cached_tokens += seq.computed
            n = int(min(seq.length - seq.computed, budget, most))
            self.alloc.grow(seq.table, seq.length + seq.max_tokens - len(seq.out) if self.reserve else seq.computed + n)
            self.waiting.popleft()
            seq.order = next(self.orders)
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        return plan

    def computed(self, seq: Seq) -> None:
        """After a step fed ``seq``: publish its blocks that are now full and computed (prefix caching)."""
        full = seq.computed // self.alloc.block_size
        if self.alloc.prefix_cache and full > seq.published:  # a block was completed: once per block_size tokens
            keys = self.alloc.chain(seq.tokens(0, full * self.alloc.block_size), full, seq.keys)
            self.alloc.publish(seq.table[seq.published:full], keys[seq.published:full])
            seq.published = full
        if self.window is not None:  # blocks wholly before the first key the next query sees
            dead = max(seq.computed - self.window + 1, 0) // self.alloc.block_size
            if dead > seq.dropped:
                self.alloc.drop(seq.table, seq.dropped, dead)
                self.window_freed += dead - seq.dropped
                seq.dropped = dead

    def _cached(self, seq: Seq) -> list[int]:
        """Cached blocks ``seq`` may start from: its longest published prefix, the last known token left out."""
        if not (self.alloc.prefix_cache and seq.reuses_prefix) or self.reserve:
            return []
        full = (seq.length - 1) // self.alloc.block_size
        return self.alloc.match(self.alloc.chain(seq.tokens(0, full * self.alloc.block_size), full, seq.keys))

    def _fits(self, seq: Seq, hits: list[int]) -> bool:
        """Whether ``seq`` may be admitted: the blocks of prompt + max_tokens (reserving), else of its known
        tokens beyond the cached ``hits`` and the watermark, are available."""
        alloc = self.alloc
        if self.reserve:
            return alloc.blocks_for(seq.length + seq.max_tokens - len(seq.out)) <= alloc.available
        most = self.window_blocks or alloc.num_blocks  # what a sequence holds at once
        watermark = alloc.num_blocks // 100 if self.running else 0  # alone, a sequence may take every block
        idle_hits = sum(1 for b in hits if b in alloc.evictable)  # sharing them takes them off the evictable list
        return min(alloc.blocks_for(seq.length) - len(hits), most) + watermark <= alloc.available - idle_hits

    def _preempt(self, seq: Seq) -> None:
        self.alloc.release(seq.table)
        seq.computed = seq.published = seq.dropped = 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1
