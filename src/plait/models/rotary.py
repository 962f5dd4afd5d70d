"""Rotary position tables (Su et al. 2021, "RoFormer"): the cos and sin of every position's angles, built once
and shared by all attention layers of a model instead of once per layer."""

from __future__ import annotations

import torch

Tables = tuple[torch.Tensor, torch.Tensor]  # cos, and sin with its first half negated (``rotate``)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., hd] rotated by the tables' angles: x·cos + (-x2, x1)·sin with x = (x1, x2) halves of hd, taken as
    x·cos + (x2, x1)·(-sin, sin): a roll of x against the tables' sin whose first half is negated (the same
    products, each with the same sign, as the rotate-half form)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class RotaryTables:
    """The cos/sin tables of one model's rotary embeddings; its attention modules share one instance.

    Every layer rotates its q and k by the same angles, so the tables of the last request are kept and handed
    to each layer that asks for the same again: a forward (or a decoding step) builds them once, not once per
    layer. Two requests, one table kept for each:

    ``rope(S, offset, dtype, device)``  positions offset..offset+S-1, cos and signed sin [S, hd]; kept per
        (S, offset, dtype, device).
    ``rope_at(pos, dtype, device)``  per-row positions ``pos`` [B, S], cos and signed sin [B, 1, S, hd]; kept per
        positions *tensor*: the same object again (held here, so its identity cannot be reused) at the same
        version counter, i.e. not changed in place since. Callers that want the layers to share the tables pass
        them one positions tensor a step. An inference-mode tensor has no version counter, so its tables are
        always rebuilt.

    The tables never require grad and hold no autograd graph (their inputs are constants). Tables built under
    ``torch.inference_mode`` are inference tensors, which autograd may not save, so they are kept apart from
    the others (the mode is part of the key). A model moved to another device or dtype asks with that device or
    dtype, which misses and rebuilds.
    """

    def __init__(self, head_dim: int, theta: float):
        self.head_dim, self.theta = head_dim, theta
        # each memo is one (key, tables) tuple, replaced whole: a reader never pairs one key with other tables
        self._range: tuple[tuple, Tables] | None = None
        self._at: tuple[torch.Tensor, tuple, Tables] | None = None  # (positions, key, tables)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """RoPE frequencies theta^(-2i/hd), always float32 (a bf16 copy would blur long positions)."""
        hd = self.head_dim
        exponents = torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd
        return 1.0 / (self.theta ** exponents)  # [hd/2]

    def rope(self, seq_len: int, offset: int, dtype: torch.dtype, device: torch.device) -> Tables:
        """cos, signed sin [S, hd] at positions offset..offset+S-1 (kept for the next call with the same
        arguments)."""
        key = (seq_len, offset, dtype, device, torch.is_inference_mode_enabled())
        kept = self._range
        if kept is None or kept[0] != key:
            kept = self._range = key, self.build_range(seq_len, offset, dtype, device)
        return kept[1]

    def rope_at(self, pos: torch.Tensor, dtype: torch.dtype, device: torch.device) -> Tables:
        """cos, signed sin [B, 1, S, hd] at per-row positions ``pos`` [B, S] (kept while ``pos`` is unchanged)."""
        if pos.is_inference():
            return self.build_at(pos, dtype, device)
        key = (pos._version, dtype, device, torch.is_inference_mode_enabled())
        kept = self._at
        if kept is None or kept[0] is not pos or kept[1] != key:
            kept = self._at = pos, key, self.build_at(pos, dtype, device)
        return kept[2]

    def build_range(self, seq_len: int, offset: int, dtype: torch.dtype, device: torch.device) -> Tables:
        """The tables of ``rope``, computed (no memo)."""
        with torch.no_grad():
            inv_freq = self.inv_freq(device)
            pos = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float32)
            freqs = torch.outer(pos, inv_freq)  # [S, hd/2]
            return _tables(freqs, dtype)

    def build_at(self, pos: torch.Tensor, dtype: torch.dtype, device: torch.device) -> Tables:
        """The tables of ``rope_at``, computed (no memo)."""
        with torch.no_grad():
            inv_freq = self.inv_freq(device)
            freqs = pos.to(device, torch.float32)[..., None] * inv_freq  # [B, S, hd/2]
            return _tables(freqs[:, None], dtype)  # [B, 1, S, hd]


def _tables(freqs: torch.Tensor, dtype: torch.dtype) -> Tables:
    """freqs [..., hd/2] (float32 angles) -> cos (c, c) and signed sin (-s, s) [..., hd] in ``dtype``."""
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
