"""Selective recomputation on one device: what one decoder layer keeps for backward, measured, equals the
per-layer count docs/runtime.md gives ("Activation memory"), with and without it; gradients are unchanged."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness import rel_err
from memory_util import layer_bytes, saved_bytes
from plait.errors import ConfigError
from plait.models import LlamaConfig
from plait.models.llama import DecoderLayer
from plait.models.registry import family_of
from plait.recompute import RecomputedCore, recompute_attention

B, S, H, A = 2, 64, 64, 4


@pytest.mark.parametrize("kv", [4, 2])
@pytest.mark.parametrize("kernel,dtype", [("fused", torch.float32), ("math", torch.float32),
                                          ("fused", torch.bfloat16)])
def test_layer_saved_bytes_equal_the_count(kv, kernel, dtype):
    cfg = LlamaConfig(dim=H, n_heads=A, n_kv_heads=kv, n_layers=1, max_seq_len=S)
    x0 = torch.randn(B, S, H, dtype=dtype)
    measured, grads = {}, {}
    for mode in ("none", "selective"):
        torch.manual_seed(0)
        layer = DecoderLayer(cfg).to(dtype)
        if mode == "selective":
            recompute_attention({"self_attn": layer.self_attn})
        x = x0.clone().requires_grad_()
        backend = SDPBackend.MATH if kernel == "math" else SDPBackend.FLASH_ATTENTION
        with sdpa_kernel(backend):
            measured[mode], out = saved_bytes(layer, x, layer.parameters())
            out.square().sum().backward()
        grads[mode] = [x.grad] + [p.grad for p in layer.parameters()]
        assert measured[mode] == layer_bytes(cfg, B, S, mode, kernel, dtype=dtype), (mode, measured[mode])
    assert measured["selective"] < measured["none"]
    assert max(rel_err(g, r) for g, r in zip(grads["selective"], grads["none"], strict=True)) == 0.0


def test_recomputed_core_is_installed_once_and_transparent_without_grad():
    cfg = LlamaConfig(dim=32, n_heads=4, n_layers=2, max_seq_len=16)
    from plait.models import Llama

    model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        before = model(tokens)
    modules = family_of(model).attention_modules(model)
    assert recompute_attention(modules) == 2 and recompute_attention(modules) == 2
    assert all(type(m.__dict__["core"]) is RecomputedCore and not isinstance(m.core.core, RecomputedCore)
               for m in modules.values())
    with torch.no_grad():
        assert torch.equal(model(tokens), before)


def test_selective_needs_attention_modules():
    with pytest.raises(ConfigError, match="selective"):
        recompute_attention({}, "Sequential")
