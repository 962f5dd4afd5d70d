"""plait.models.kv_cache.KVCache: keys and values appended in place into buffers that grow by doubling; attention
over them with the mask a chunk needs (none for one token); on a GPU, keys read to a rounded length, the rest
masked."""

import pytest
import torch
import torch.nn.functional as F

from plait.context_parallel.attention import whole_sequences
from plait.errors import ConfigError
from plait.models import Llama, LlamaConfig
from plait.models.kv_cache import KVCache


def test_kv_cache_returns_what_a_concatenation_would_and_grows_by_doubling():
    g = torch.Generator().manual_seed(0)
    cache = KVCache()
    prompt = [torch.randn(2, 3, 5, 4, generator=g) for _ in range(2)]
    keys, values, mask = cache.append(*prompt)
    assert mask is None and cache.length == 5 and cache.capacity == 5
    assert torch.equal(keys, prompt[0]) and torch.equal(values, prompt[1])
    tokens = [[torch.randn(2, 3, 1, 4, generator=g) for _ in range(2)] for _ in range(7)]
    for k, v in tokens:
        keys, values, mask = cache.append(k, v)
        assert mask is None  # a CPU reads exactly the keys there are
    assert torch.equal(keys, torch.cat([prompt[0], *(k for k, _ in tokens)], dim=2))
    assert torch.equal(values, torch.cat([prompt[1], *(v for _, v in tokens)], dim=2))
    assert cache.length == 12 and cache.capacity == 20  # 5, then 10 at the 6th position, 20 at the 11th
    buffer = cache.keys.data_ptr() if cache.keys is not None else None
    cache.append(*tokens[0])  # within capacity: written in place, nothing reallocated or copied
    assert cache.keys is not None and cache.keys.data_ptr() == buffer and cache.length == 13


def test_one_token_after_the_cache_attends_without_a_mask_and_matches_the_full_forward(monkeypatch):
    """Decoding one token after cached ones: every layer calls SDPA with no mask and not causal (the token sees
    every key; SDPA's own causal mask is top-left and would hide all but the first), a chunk of several tokens
    with the offset causal mask; the logits equal those of one forward over the whole sequence."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)).eval()
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    calls: list[tuple[bool, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((attn_mask is not None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    with torch.no_grad():
        full = model(tokens)
        caches = [KVCache() for _ in range(2)]
        parts = [model(tokens[:, :5], caches), model(tokens[:, 5:8], caches), model(tokens[:, 8:], caches)]
    assert calls == [(False, True)] * 2 + [(False, True)] * 2 + [(True, False)] * 2 + [(False, False)] * 2
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_context_parallel_cores_refuse_a_non_causal_call():
    whole_sequences(True)
    with pytest.raises(ConfigError, match="decode with a model loaded under cp=1"):
        whole_sequences(False)


def test_decoding_takes_one_cache_per_kv_layer_from_the_models_family():
    """The decoder names no model class: each KV layer's cache comes from the family adapter (a Llama-built
    family's is a KVCache); a family whose blocks keep no cache says so if asked for one."""
    from torch import nn

    from plait.generation.decode import Decoder
    from plait.models.qwen3 import Qwen3, Qwen3Config
    from plait.models.registry import family_of

    model = Qwen3(Qwen3Config(vocab_size=64, dim=16, n_layers=3, n_heads=2, max_seq_len=32))
    caches = Decoder(model).new_caches()
    assert list(caches) == ["layers.0", "layers.1", "layers.2"]
    assert all(isinstance(c, KVCache) and c.length == 0 for c in caches.values())
    assert len({id(c) for c in caches.values()}) == 3  # one each
    with pytest.raises(ConfigError, match="keep no KV cache"):
        family_of(nn.Sequential(nn.Linear(2, 2))).kv_cache()


def test_a_rounding_cache_reads_whole_blocks_of_keys_the_ones_past_its_length_zero_and_masked():
    """With ``round_keys`` (a GPU's default) the keys after the first chunk are read to ``rounded_key_length``:
    one shape for many tokens; the keys past the stored ones are zeros (a masked value is still multiplied) and
    the mask hides them, causally for a chunk."""
    from plait.models.kv_cache import rounded_key_length

    g = torch.Generator().manual_seed(0)
    cache = KVCache(round_keys=True)
    prompt = [torch.randn(1, 2, 5, 4, generator=g) for _ in range(2)]
    keys, _, mask = cache.append(*prompt)
    assert keys.shape[2] == 5 and mask is None  # the first chunk: exactly its keys, SDPA's causal mask
    chunk = [torch.randn(1, 2, 3, 4, generator=g) for _ in range(2)]
    keys, values, mask = cache.append(*chunk)
    assert keys.shape[2] == 16 and mask is not None and mask.shape == (3, 16)
    assert mask.tolist() == [[j <= 5 + i for j in range(16)] for i in range(3)]
    assert torch.equal(keys[:, :, 5:8], chunk[0]) and torch.equal(values[:, :, 5:8], chunk[1])
    assert not keys[:, :, 8:].any() and not values[:, :, 8:].any()
    lengths = []
    for _ in range(40):
        keys, _, mask = cache.append(*(x[:, :, :1] for x in chunk))
        lengths.append(keys.shape[2])
        assert mask is not None or keys.shape[2] == cache.length
        assert keys.shape[2] == rounded_key_length(cache.length) >= cache.length
    assert lengths == [16] * 8 + [32] * 16 + [48] * 16  # 9..48 positions: three shapes, not forty
    assert KVCache().append(*prompt)[0].shape[2] == 5 and rounded_key_length(69) == 80


@pytest.mark.parametrize("window", [None, 6])
def test_generate_with_rounded_keys_repeats_attentions_shapes_and_gives_the_same_tokens(monkeypatch, window):
    """plait.generate on a device that rounds key lengths (``plait.key_lengths.rounds_key_lengths`` made to say yes,
    as it does for CUDA): its decode steps hand attention a few key lengths, not one more each token, and every
    greedy token is the exact-length decode's; with a sliding window too. Prompts of different lengths: the
    longer ones' tokens are fed one column at a time after the common prefix, reading rounded keys."""
    import plait
    from plait import key_lengths

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96,
                      sliding_window=window)
    model = Llama(cfg).eval()
    prompts = [[5, 9, 2, 7, 1, 3, 8, 8, 1], [4, 4, 8], [3, 1, 4, 1, 5]]
    exact = plait.generate(model, prompts, max_new_tokens=40)
    lengths: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, is_causal=False, **kw):
        lengths.append(k.shape[2])
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    monkeypatch.setattr(key_lengths, "rounds_key_lengths", lambda device: True)
    rounded = plait.generate(model, prompts, max_new_tokens=40)
    assert rounded == exact
    steps = lengths[2::2]  # one call per layer: the decode steps after the prefill
    assert len(steps) == 9 + 40 - 3 - 1 and all(n % 16 == 0 for n in steps), steps
    assert len(set(steps)) == 3, f"a new key length every step: {sorted(set(steps))}"
