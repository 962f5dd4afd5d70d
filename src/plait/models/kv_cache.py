"""``KVCache``: the keys and values one attention layer has seen so far, for decoding a batch of sequences that
share their positions."""

from __future__ import annotations

import torch

from plait import key_lengths

#: The block a rounded key length is a whole number of (``plait.key_lengths.rounded_key_length``).
KEY_BLOCK = 16


class KVCache:
    """Keys and values one attention layer has seen so far ([B, h_kv, L, hd]); created by whoever holds the layer.

    They live in buffers of room for ``capacity`` positions that grow by doubling, so appending a token
    copies that token (and, at each doubling, what is there), where a concatenation would copy the whole cache
    at every token: O(L) bytes moved over a sequence instead of O(L²).

    ``round_keys`` (None: ``plait.key_lengths.rounds_key_lengths`` of the keys' device, on for CUDA): after the first
    chunk, attention reads the keys of ``rounded_key_length(length, KEY_BLOCK)`` positions, the ones past
    ``length`` zeros and masked, so that decoding meets a few shapes rather than a new one every token. Off,
    it reads exactly ``length`` keys.

    Any other cache object passed to ``Attention`` is a per-row cache, whose rows may sit at different
    positions (serving keeps such caches outside the model): ``positions(s)`` gives the positions [B, S] of
    the next ``s`` tokens of each row. Both kinds' ``append(k, v)`` store the new keys and values [B, h_kv, S, hd]
    and return the keys and values of positions 0..L-1 to attend to [B, h_kv, L, hd] with the causal mask
    (here [S, L], per row [B, 1, S, L]), or None for the mask when the keys are exactly the ones there are.
    """

    def __init__(self, round_keys: bool | None = None) -> None:
        self.keys: torch.Tensor | None = None  # [B, h_kv, capacity, hd]
        self.values: torch.Tensor | None = None
        self.length = 0  # positions stored
        self.round_keys = round_keys

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store ``k``, ``v`` [B, h_kv, S, hd] after what is there; the keys and values to attend to, views
        [B, h_kv, L, hd] of the buffers, and the mask [S, L] (None when L is the new length: no key to hide)."""
        start, end = self.length, self.length + k.shape[2]
        rounds = key_lengths.rounds_key_lengths(k.device) if self.round_keys is None else self.round_keys
        length = rounded_key_length(end) if rounds and start > 0 else end  # L
        if length > self.capacity:
            room = max(length, 2 * self.capacity)  # zeros past the keys: a masked key's value is still read
            keys, values = (x.new_zeros(*x.shape[:2], room, x.shape[3]) for x in (k, v))
            if self.keys is not None and self.values is not None:
                keys[:, :, :start] = self.keys[:, :, :start]
                values[:, :, :start] = self.values[:, :, :start]
            self.keys, self.values = keys, values
        assert self.keys is not None and self.values is not None
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        self.length = end
        mask = None
        if length > end:  # query i sits at position start + i and sees keys 0..start + i
            pos = torch.arange(start, end, device=k.device)
            mask = torch.arange(length, device=k.device) <= pos[:, None]
        return self.keys[:, :, :length], self.values[:, :, :length], mask


def rounded_key_length(end: int) -> int:
    """The keys' length a rounding cache reads with ``end`` keys stored."""
    return key_lengths.rounded_key_length(end, KEY_BLOCK)
