"""Paged KV cache for serving: fixed-size blocks of every attention layer, block tables, and the allocator.

The idea of vLLM (Kwon et al. 2023, "PagedAttention"): a sequence's keys and values live in fixed-size
blocks taken from a shared pool as the sequence grows, found through its block table (logical block i ->
physical block), so memory is held only for tokens that exist, not reserved up front for prompt +
max_tokens. Rank 0's ``BlockAllocator`` decides which blocks each sequence gets and puts the tables into
the step's plan; every rank's ``PagedKVCache`` layers write and read their own heads of those blocks.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict

import torch


class BlockAllocator:
    """The blocks of a pool of ``num_blocks`` blocks of ``block_size`` positions (bookkeeping only).

    Prefix caching (``prefix_cache=True``; vLLM's automatic prefix caching): a block whose positions are all
    computed is published under a key that names every token up to its end (a hash chained block by block),
    so a later sequence whose tokens start the same way shares it instead of computing it again. A block is
    held by the tables that reference it (a count); when the last lets go, a published block stays cached
    (``evictable``, least recently used first) until a new block is needed and no free one is left. Keys
    and values at a position depend only on the tokens up to it (causal attention), so a shared block holds
    exactly what the sequence would have computed.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = False) -> None:
        self.num_blocks, self.block_size, self.prefix_cache = num_blocks, block_size, prefix_cache
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids are handed out first
        self.refs: dict[int, int] = {}  # block -> tables holding it
        self.keys: dict[bytes, int] = {}  # published prefix key -> block
        self.key_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # published, held by no table; oldest first

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    @property
    def used(self) -> int:
        """Blocks held by at least one table (cached blocks nobody holds are not counted)."""
        return self.num_blocks - len(self.free) - len(self.evictable)

    @property
    def available(self) -> int:
        """Blocks a table may still take: the free ones and the cached ones nobody holds."""
        return len(self.free) + len(self.evictable)

    def grow(self, table: list[int], positions: int) -> bool:
        """Extend ``table`` to cover ``positions``; False (and no change) when too few blocks are available."""
        need = self.blocks_for(positions) - len(table)
        if need <= 0:
            return True
        if need > self.available:
            return False
        for _ in range(need):
            block = self.free.pop() if self.free else self._evict()
            self.refs[block] = 1
            table.append(block)
        return True

    def _evict(self) -> int:
        block, _ = self.evictable.popitem(last=False)
        del self.keys[self.key_of.pop(block)]
        return block

    def release(self, table: list[int]) -> None:
        for block in reversed(table):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
        table.clear()

    # ----------------------------------------------------------------------------------- prefix caching
    def chain(self, tokens: list[int], blocks: int, keys: list[bytes]) -> list[bytes]:
        """``keys`` extended to the first ``blocks`` full blocks of ``tokens``: key i names tokens [0, (i+1)·block)."""
        b = self.block_size
        while len(keys) < blocks:
            i = len(keys)
            h = hashlib.sha256(keys[-1] if keys else b"")
            h.update(array("q", tokens[i * b:(i + 1) * b]).tobytes())
            keys.append(h.digest())
        return keys

    def match(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest published prefix among ``keys``."""
        out = []
        for key in keys if self.prefix_cache else ():
            block = self.keys.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def share(self, table: list[int], blocks: list[int]) -> None:
        """Append cached ``blocks`` to an empty ``table`` (they leave the evictable list while held)."""
        for block in blocks:
            self.refs[block] = self.refs.get(block, 0) + 1
            self.evictable.pop(block, None)
            table.append(block)

    def publish(self, table: list[int], keys: list[bytes]) -> None:
        """Publish the full, computed blocks ``table[i]`` under ``keys[i]`` (first come, first published)."""
        for block, key in zip(table, keys if self.prefix_cache else (), strict=False):
            if key not in self.keys and block not in self.key_of:
                self.keys[key], self.key_of[block] = block, key


class PagedBatch:
    """The rows of the next forward, shared by every layer's cache: block tables [B, n] and start positions [B]."""

    def __init__(self) -> None:
        self.tables = torch.zeros(1, 1, dtype=torch.long)
        self.starts = torch.zeros(1, dtype=torch.long)

    def set(self, tables: list[list[int]], starts: list[int]) -> None:
        width = max(len(t) for t in tables)
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        self.starts = torch.tensor(starts, dtype=torch.long)


class PagedKVCache:
    """One attention layer's keys and values in blocks ([blocks, h_kv, block, hd] each), read through block tables.

    A per-row cache for ``Attention`` (see ``plait.models.llama.KVCache``): row b's tokens go to positions
    ``starts[b]``, ``starts[b] + 1``, ...; position p lives in block ``tables[b, p // block]`` at offset
    ``p % block``. The pool is allocated at the first write, when this rank's head count and dtype are known.
    """

    def __init__(self, num_blocks: int, block_size: int, batch: PagedBatch) -> None:
        self.num_blocks, self.block_size, self.batch = num_blocks, block_size, batch
        self.k: torch.Tensor | None = None  # [blocks, h_kv, block, hd]
        self.v: torch.Tensor | None = None

    def positions(self, s: int) -> torch.Tensor:
        """Positions [B, S] of the next ``s`` tokens of each row."""
        return self.batch.starts[:, None] + torch.arange(s)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store k, v [B, h_kv, S, hd] in the rows' blocks; (keys, values of positions 0..L-1, causal mask or None)."""
        b, h, s, hd = k.shape
        if self.k is None or self.v is None:  # zeros: a block's unused tail is read (then masked), must be finite
            self.k = k.new_zeros(self.num_blocks, h, self.block_size, hd)
            self.v = v.new_zeros(self.num_blocks, h, self.block_size, hd)
        pool_k, pool_v = self.k, self.v
        tables, starts = self.batch.tables.to(k.device), self.batch.starts
        pos = self.positions(s).to(k.device)  # [B, S]
        blocks = tables.gather(1, pos // self.block_size)  # [B, S]
        offsets = pos % self.block_size
        pool_k[blocks, :, offsets] = k.transpose(1, 2)  # [B, S, h_kv, hd] into each token's block and offset
        pool_v[blocks, :, offsets] = v.transpose(1, 2)
        if int(starts.max()) == 0:  # every row starts fresh: plain causal attention over the new keys
            return k, v, None
        total = int((starts + s).max())
        n = math.ceil(total / self.block_size)
        keys = self._gather(pool_k, tables[:, :n], total)
        values = self._gather(pool_v, tables[:, :n], total)
        mask = torch.arange(total, device=k.device) <= pos[:, :, None]  # [B, S, L]: keys past a row's end are later
        return keys, values, mask[:, None]

    def _gather(self, pool: torch.Tensor, tables: torch.Tensor, total: int) -> torch.Tensor:
        b, n = tables.shape
        h, hd = pool.shape[1], pool.shape[3]
        x = pool[tables]  # [B, n, h_kv, block, hd]
        return x.transpose(1, 2).reshape(b, h, n * self.block_size, hd)[:, :, :total]
