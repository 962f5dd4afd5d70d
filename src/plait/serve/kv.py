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
from typing import NamedTuple

import torch

from plait.devices import to_device
from plait.key_lengths import rounded_key_length, rounds_key_lengths


class BlockAllocator:
    """The blocks of a pool of ``num_blocks`` blocks of ``block_size`` positions (bookkeeping only).

    Prefix caching (``prefix_cache=True``; vLLM's automatic prefix caching): a block whose positions are all
    computed is published under a key that names every token up to its end (a hash chained block by block),
    so a later sequence whose tokens start the same way shares it instead of computing it again. A block is
    held by the tables that reference it (a count); when the last lets go, a published block stays cached
    (``evictable``, least recently used first) until a new block is needed and no free one is left. Keys
    and values at a position depend only on the tokens up to it (causal attention), so a shared block holds
    exactly what the sequence would have computed.

    A table may let go of its leading blocks early (``drop``: no query of a sliding-window model will see them
    again); their entries then hold ``hole``, the id of the runner's spare block past the pool, read (finite
    values) and hidden by the window's mask.
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

    @property
    def hole(self) -> int:
        """The entry of a block a table let go of (``drop``)."""
        return self.num_blocks

    def release(self, table: list[int]) -> None:
        for block in reversed(table):
            self._let_go(block)
        table.clear()

    def drop(self, table: list[int], start: int, stop: int) -> None:
        """Let go of ``table[start:stop]`` (blocks no query will see again), each entry now ``hole``."""
        for i in range(start, stop):
            self._let_go(table[i])
            table[i] = self.hole

    def _let_go(self, block: int) -> None:
        if block == self.hole:
            return
        self.refs[block] -= 1
        if self.refs[block] == 0:
            del self.refs[block]
            if block in self.key_of:
                self.evictable[block] = None
            else:
                self.free.append(block)

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


class StepView(NamedTuple):
    """What every attention layer of one forward reads from the paged cache, on the device; built once by
    ``PagedBatch.view`` and shared by all of them (B rows of S new tokens, L positions attended to).

    A slot is one position of one block: position p of row b sits in slot ``tables[b, p // block] * block +
    p % block`` of the pool.
    """

    pos: torch.Tensor  # [B, S] positions of the new tokens
    slots: torch.Tensor  # [B·S] the slot each new token is written to (row-major)
    keys: torch.Tensor | None  # [B·L] slots of positions 0..L-1, row by row; None when every row starts at 0
    length: int  # L: the furthest row's end, rounded up (``PagedBatch.key_length``) unless every row starts at 0
    mask: torch.Tensor | None  # [B, 1, S, L] causal per row (a short row's later keys are padding); None likewise


class PagedBatch:
    """The rows of the next forward, shared by every layer's cache: their block tables and start positions.

    ``set`` keeps the host lists (the runner calls it once per row group and pipeline chunk); the first layer
    of that forward to ask for ``view(s)`` builds what all of them read on the device, in one host-to-device
    copy (``plait.devices.to_device``: queued without a wait on a GPU), and the other layers reuse it: no copy
    to the device and no read of a device value per layer. ``builds`` counts the views built.

    Rows shorter than the forward (``lengths`` below its S: prompt chunks padded to the group's longest) give
    their padding positions the row's last real position (a valid position for RoPE and the mask) and write
    its keys and values to a spare block after the pool's ``num_blocks``, which no table holds: padding
    never touches a sequence's blocks.

    ``round_keys`` (on for a CUDA device, off elsewhere): rows past their first chunk read keys up to
    ``key_length`` of the furthest row's end, not the end itself, and a forward of one-token rows runs
    ``row_count`` rows (the runner adds ``padding_row``s, outputs dropped), so that attention and every other
    layer meet a few shapes, not a new one every step or whenever a sequence joins or leaves the batch.
    """

    #: The block a rounded row count is a whole number of (``row_count``).
    ROW_BLOCK = 8

    def __init__(self, block_size: int, device: torch.device, num_blocks: int) -> None:
        self.block_size, self.device = block_size, device
        self.round_keys = rounds_key_lengths(device)
        self.spare_block = num_blocks  # the block padding writes to, past the pool
        self.spare = num_blocks * block_size  # its first slot
        self.tables: list[list[int]] = [[0]]
        self.starts: list[int] = [0]
        self.lengths: list[int] | None = None
        self.builds = 0
        self._view: StepView | None = None
        self._masks: dict[torch.dtype, torch.Tensor] = {}

    def set(self, tables: list[list[int]], starts: list[int], lengths: list[int] | None = None) -> None:
        """The next forward's rows; ``lengths``: each row's real new tokens (None: all of the forward's S)."""
        self.tables, self.starts, self.lengths, self._view = tables, starts, lengths, None
        self._masks = {}

    def view(self, s: int) -> StepView:
        """The device tensors of the next ``s`` tokens of each row (built at the first call after ``set``)."""
        if self._view is None or self._view.pos.shape[1] != s:
            self._view, self._masks = self._build(s), {}
        return self._view

    def additive_mask(self, s: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The view's mask as attention adds it to the scores (0 where a key is seen, -inf where not) in
        ``dtype``, made once per forward: a boolean mask would be converted again by every layer's attention."""
        view = self.view(s)
        if view.mask is None:
            return None
        if dtype not in self._masks:
            self._masks[dtype] = torch.zeros(view.mask.shape, dtype=dtype, device=self.device).masked_fill(
                ~view.mask, float("-inf"))
        return self._masks[dtype]

    def key_length(self, end: int) -> int:
        """How many positions a forward with rows reaching ``end`` reads keys of: with ``round_keys``,
        ``plait.key_lengths.rounded_key_length`` of ``end`` in this pool's blocks (the extra keys all masked); else
        ``end``."""
        return rounded_key_length(end, self.block_size) if self.round_keys else end

    def row_count(self, n: int) -> int:
        """How many rows a forward of ``n`` one-token rows runs: with ``round_keys``,
        ``plait.key_lengths.rounded_key_length`` of ``n`` in blocks of ``ROW_BLOCK``; else ``n``."""
        return rounded_key_length(n, self.ROW_BLOCK) if self.round_keys else n

    def padding_row(self) -> tuple[list[int], int, int]:
        """(table, start, length) of a row that only pads a forward: no real token (length 0), so its one
        position is 0 (start 1, minus one), its keys and values go to the spare block and it reads position 0 of
        that block (finite values: the pool's zeros or earlier padding); no sequence's blocks are touched."""
        return [self.spare_block], 1, 0

    def _build(self, s: int) -> StepView:
        self.builds += 1
        bs, lengths = self.block_size, self.lengths or [s] * len(self.starts)
        fresh = max(self.starts) == 0  # every row starts at 0 (from the host lists: no read of a device value)
        end = max(start + n for start, n in zip(self.starts, lengths, strict=True))
        length = end if fresh else self.key_length(end)  # the keys' length L
        width = max(max(len(t) for t in self.tables), -(-length // bs))  # table columns: L's blocks at least
        host = torch.tensor([[start, n, *t] + [0] * (width - len(t))
                             for start, n, t in zip(self.starts, lengths, self.tables, strict=True)])
        both = to_device(host, self.device)  # [B, 2 + width]: start, length, then the block table (padded with 0)
        starts, tables = both[:, 0], both[:, 2:]
        step = torch.arange(s, device=self.device)
        real = step < both[:, 1:2]  # [B, S]: False at a short row's padding
        pos = starts[:, None] + torch.minimum(step, both[:, 1:2] - 1)  # [B, S]
        slots = tables.gather(1, pos // bs) * bs + pos % bs
        if self.lengths is not None:
            slots = torch.where(real, slots, self.spare + step % bs)
        slots = slots.flatten()
        if fresh:
            return StepView(pos, slots, None, s, None)
        every = torch.arange(length, device=self.device)  # [L]: the positions up to the furthest row's end, and on
        keys = (tables[:, every // bs] * bs + every % bs).flatten()  # [B·L]
        return StepView(pos, slots, keys, length, (every <= pos[:, :, None])[:, None])


class PagedKVCache:
    """One attention layer's keys and values in blocks of slots ([blocks·block, h_kv, hd] each, block after block,
    then the spare block padding writes to), read through the rows' block tables.

    A per-row cache for ``Attention`` (see ``plait.models.kv_cache.KVCache``): row b's tokens go to positions
    ``starts[b]``, ``starts[b] + 1``, ...; position p lives in block ``tables[b, p // block]`` at offset
    ``p % block``. The pool is allocated at the first write, when this rank's head count and dtype are known.
    Which slots a step writes and reads, and the mask, come from the batch's ``StepView``: the same tensors for
    every layer, so a layer runs one indexed write and one indexed read for its keys, and the same for values.
    """

    def __init__(self, num_blocks: int, block_size: int, batch: PagedBatch) -> None:
        self.num_blocks, self.block_size, self.batch = num_blocks, block_size, batch
        self.k: torch.Tensor | None = None  # [(blocks + 1)·block, h_kv, hd]
        self.v: torch.Tensor | None = None

    def positions(self, s: int) -> torch.Tensor:
        """Positions [B, S] of the next ``s`` tokens of each row, on the device (one tensor for every layer)."""
        return self.batch.view(s).pos

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store k, v [B, h_kv, S, hd] in the rows' slots; (keys, values of positions 0..L-1, causal mask or None)."""
        b, h, s, hd = k.shape
        if self.k is None or self.v is None:  # zeros: a block's unused tail is read (then masked), must be finite
            self.k = k.new_zeros((self.num_blocks + 1) * self.block_size, h, hd)  # + the padding's spare block
            self.v = v.new_zeros((self.num_blocks + 1) * self.block_size, h, hd)
        view = self.batch.view(s)
        self.k.index_copy_(0, view.slots, k.transpose(1, 2).reshape(-1, h, hd))  # [B·S, h_kv, hd]
        self.v.index_copy_(0, view.slots, v.transpose(1, 2).reshape(-1, h, hd))
        if view.keys is None:  # every row starts fresh: plain causal attention over the new keys
            return k, v, None
        shape = (b, view.length, h, hd)
        keys = self.k.index_select(0, view.keys).view(shape).transpose(1, 2)  # [B, h_kv, L, hd]
        values = self.v.index_select(0, view.keys).view(shape).transpose(1, 2)
        return keys, values, self.batch.additive_mask(s, k.dtype)
