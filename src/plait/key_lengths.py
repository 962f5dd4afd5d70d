"""The keys' length attention reads when decoding: exact, or rounded up so that a shape comes back.

Shared by ``plait.generate``'s KV cache (``plait.models.kv_cache``) and the serving runner's paged batch
(``plait.serve.kv``): the rule is about the shapes attention sees, not about either cache.
"""

from __future__ import annotations

import torch


def rounds_key_lengths(device: torch.device) -> bool:
    """Whether attention on ``device`` should read keys up to ``rounded_key_length`` rather than the exact count
    (a CUDA device: its attention kernels may prepare a plan per shape; elsewhere the exact count, whose outputs'
    bits the extra masked keys would move)."""
    return device.type == "cuda"


def rounded_key_length(end: int, block: int) -> int:
    """``end`` keys rounded up to a whole ``block`` and to 1/8 of its power of two (past a block, at most an
    eighth more keys), for a decoder that masks the keys past ``end``.

    The keys' length is part of the shape attention sees. A GPU attention kernel may be prepared per shape
    (cuDNN's builds and caches an execution plan for each, which costs far more than running it): were the
    length exact, every decoding step would bring a new one; rounded, a shape comes back for the next steps,
    and a sequence meets a few per doubling of its length.
    """
    step = max(block, 1 << max(0, end.bit_length() - 4))
    return -(-end // step) * step
