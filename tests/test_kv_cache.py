"""plait.models.llama.KVCache: keys and values appended in place into buffers that grow by doubling."""

import torch

from plait.models.llama import KVCache


def test_kv_cache_returns_what_a_concatenation_would_and_grows_by_doubling():
    g = torch.Generator().manual_seed(0)
    cache = KVCache()
    prompt = [torch.randn(2, 3, 5, 4, generator=g) for _ in range(2)]
    keys, values = cache.append(*prompt)
    assert cache.length == 5 and cache.capacity == 5
    assert torch.equal(keys, prompt[0]) and torch.equal(values, prompt[1])
    tokens = [[torch.randn(2, 3, 1, 4, generator=g) for _ in range(2)] for _ in range(7)]
    for k, v in tokens:
        keys, values = cache.append(k, v)
    assert torch.equal(keys, torch.cat([prompt[0], *(k for k, _ in tokens)], dim=2))
    assert torch.equal(values, torch.cat([prompt[1], *(v for _, v in tokens)], dim=2))
    assert cache.length == 12 and cache.capacity == 20  # 5, then 10 at the 6th position, 20 at the 11th
    buffer = cache.keys.data_ptr() if cache.keys is not None else None
    cache.append(*tokens[0])  # within capacity: written in place, nothing reallocated or copied
    assert cache.keys is not None and cache.keys.data_ptr() == buffer and cache.length == 13
