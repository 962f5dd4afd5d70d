"""Seeded initialisation one tensor at a time: every state tensor is drawn from a generator of its own.

The generator of tensor ``key`` is seeded by (seed, key), so a tensor's initial value depends on nothing
else: not on which tensors were drawn before it, nor on which of them a process holds. A model built on
the meta device and sharded over any layout can then draw each full tensor it owns a part of, one at a
time, keep its slice and drop the rest (plait.checkpoint.shards.init_local), and every layout — and the plain
model on one device (``init_weights``) — holds the same weights for the same seed. What each tensor's
initial value is (normal, ones, zeros; its scale) is model knowledge: the family adapter's ``init_tensor``.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from plait.models.registry import family_of


def tensor_seed(seed: int, key: str) -> int:
    """A 63-bit seed for state tensor ``key`` under the run's ``seed`` (stable across processes and runs)."""
    digest = hashlib.sha256(f"{int(seed)}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def tensor_generator(seed: int, key: str) -> torch.Generator:
    """The CPU generator tensor ``key`` is drawn from."""
    return torch.Generator().manual_seed(tensor_seed(seed, key))


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Fill every state tensor of a plain (materialised) model with its seeded initial value; returns it.

    Each tensor shared under several keys (tied embeddings) is filled once, under its first key.
    """
    family, config = family_of(model), getattr(model, "config", None)
    done: set[int] = set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in done:
            continue
        done.add(id(tensor))
        tensor.copy_(family.init_tensor(config, key, tuple(tensor.shape), seed))
    return model
