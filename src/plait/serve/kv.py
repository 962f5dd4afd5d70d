"""Paged KV cache for serving: fixed-size blocks of every attention layer, block tables, and the allocator.

The idea of vLLM (Kwon et al. 2023, "PagedAttention"): a sequence's keys and values live in fixed-size
blocks taken from a shared pool as the sequence grows, found through its block table (logical block i ->
physical block), so memory is held only for tokens that exist, not reserved up front for prompt +
max_tokens. Rank 0's ``BlockAllocator`` decides which blocks each sequence gets and puts the tables into
the step's plan; every rank's ``PagedKVCache`` layers write and read their own heads of those blocks.
"""

from __future__ import annotations

import math

import torch


class BlockAllocator:
    """The free blocks of a pool of ``num_blocks`` blocks of ``block_size`` positions (bookkeeping only)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids are handed out first

    def blocks_for(self, positions: int) -> int:
        return math.ceil(positions / self.block_size)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)

    def grow(self, table: list[int], positions: int) -> bool:
        """Extend ``table`` to cover ``positions``; False (and no change) when too few blocks are free."""
        need = self.blocks_for(positions) - len(table)
        if need <= 0:
            return True
        if need > len(self.free):
            return False
        table.extend(self.free.pop() for _ in range(need))
        return True

    def release(self, table: list[int]) -> None:
        self.free.extend(reversed(table))
        table.clear()


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
