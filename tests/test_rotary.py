"""RoPE tables are built once per forward and shared by the layers (plait.models.rotary), with the same values
as building them in every layer, rebuilt when length, offset, dtype, device, positions or inference mode change;
turning by them and the RMSNorm beside them are transformers' arithmetic bit for bit."""

from __future__ import annotations

import pytest
import torch

from plait.context_parallel.attention import GlobalRope, LocalPositions
from plait.models import Llama, LlamaConfig
from plait.models.llama import KVCache, RMSNorm
from plait.models.rotary import RotaryTables, rotate


def _model(n_layers: int = 4) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=50, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, max_seq_len=64))


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """Records every table build (``rope``'s and ``rope_at``'s) while the test runs."""
    calls: list[str] = []
    build_range, build_at = RotaryTables.build_range, RotaryTables.build_at

    def counted_range(self, *args):
        calls.append("range")
        return build_range(self, *args)

    def counted_at(self, *args):
        calls.append("at")
        return build_at(self, *args)

    monkeypatch.setattr(RotaryTables, "build_range", counted_range)
    monkeypatch.setattr(RotaryTables, "build_at", counted_at)
    return calls


def test_one_build_per_forward_not_per_layer(builds):
    model = _model(n_layers=4)
    x = torch.randint(0, 50, (2, 12))
    model(x)
    assert builds == ["range"]  # 4 layers, one table
    model.loss(x, x).backward()  # the same length again: nothing to build, and the backward is fine
    assert builds == ["range"]
    model(x[:, :7])  # another length
    assert builds == ["range", "range"]
    model.double()(x[:, :7])  # another dtype
    assert builds == ["range"] * 3
    attn = model.layers[0].self_attn
    cos, _ = attn.rope(7, 0, torch.float64)
    assert cos.dtype == torch.float64 and not cos.requires_grad and cos.grad_fn is None


def test_shared_tables_equal_tables_built_in_every_layer():
    model = _model()
    x = torch.randint(0, 50, (2, 12))
    shared = model(x)
    attn = model.layers[0].self_attn
    for a, b in zip(attn.rope(12, 3, torch.float32), attn.rotary.build_range(12, 3, torch.float32,
                                                                                torch.device("cpu")), strict=True):
        assert torch.equal(a, b)
    for layer in model.layers:  # each layer its own tables, as before they were shared
        layer.self_attn.rotary = RotaryTables(layer.self_attn.head_dim, model.config.rope_theta)
    assert torch.equal(model(x), shared)


def test_full_recomputation_reuses_the_tables(builds):
    """Each layer under a checkpoint (recompute='full' runs blocks so): the backward's recomputed forwards ask for
    the same tables and get them without a build; gradients equal those of the plain forward."""
    from torch.utils.checkpoint import checkpoint

    model = _model(n_layers=3)
    x = torch.randint(0, 50, (2, 10))
    model.loss(x, x).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    h = model.embed_tokens(x)
    for layer in model.layers:
        h = checkpoint(layer, h, use_reentrant=False)
    logits = model.lm_head(model.norm(h))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
    assert builds == ["range"]
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain, strict=True))


def test_a_new_device_rebuilds(builds):
    model = _model(n_layers=2)
    x = torch.randint(0, 50, (1, 6))
    model(x)
    model.to("meta")
    out = model(x.to("meta"))
    assert builds == ["range", "range"] and out.is_meta
    assert model.layers[1].self_attn.rope(6, 0, torch.float32)[0].is_meta


def test_decoding_builds_once_per_step(builds):
    model = _model(n_layers=3).eval()
    caches = [KVCache() for _ in model.layers]
    with torch.no_grad():
        model(torch.randint(0, 50, (1, 5)), caches)
        for _ in range(4):
            model(torch.randint(0, 50, (1, 1)), caches)
    assert builds == ["range"] * 5  # each step a new offset, one build for its 3 layers


def test_inference_mode_tables_are_not_saved_for_a_training_step(builds):
    model = _model(n_layers=2)
    x = torch.randint(0, 50, (2, 8))
    with torch.inference_mode():
        model(x)
    model.loss(x, x).backward()  # an inference tensor saved for backward would raise here
    with torch.no_grad():
        model(x)  # built in grad mode, used under no_grad: no rebuild
    assert builds == ["range", "range"]


def test_rope_at_is_kept_per_positions_tensor(builds):
    rotary = RotaryTables(8, 10000.0)
    cpu = torch.device("cpu")
    pos = torch.tensor([[3, 4], [0, 1]])
    first = rotary.rope_at(pos, torch.float32, cpu)
    assert rotary.rope_at(pos, torch.float32, cpu) is first and builds == ["at"]
    pos += 1  # changed in place: its version moves on
    moved = rotary.rope_at(pos, torch.float32, cpu)
    assert builds == ["at", "at"] and torch.equal(moved[0], rotary.build_at(torch.tensor([[4, 5], [1, 2]]),
                                                                             torch.float32, cpu)[0])
    builds.clear()
    rotary.rope_at(pos.clone(), torch.float32, cpu)  # equal values, another tensor
    rotary.rope_at(pos, torch.bfloat16, cpu)
    assert builds == ["at", "at"]
    with torch.inference_mode():
        frozen = torch.tensor([[1, 2]])
        rotary.rope_at(frozen, torch.float32, cpu)
        rotary.rope_at(frozen, torch.float32, cpu)  # no version counter to trust: built each time
    assert builds == ["at"] * 4


def test_serving_builds_the_tables_once_per_forward(builds):
    """The serving runner's paged cache hands every layer of a forward one positions tensor: one ``rope_at``
    build per row group's forward, not one per layer."""
    from plait.generation.decode import Sampling
    from plait.serve.runner import Row, Runner, Step
    from plait.serve.sampling import Params

    runner = Runner(_model(n_layers=3).eval(), num_blocks=8, block_size=4)
    params = Params(Sampling(4, 0.0))
    runner.execute(Step(new=[(0, params)], rows=[Row(0, [5, 9, 2, 7, 1], 0, [0, 1], True)]))
    runner.execute(Step(new=[], rows=[Row(0, [3], 5, [0, 1], True)]))
    assert builds == ["at", "at"]


def test_context_parallel_layers_share_one_positions_tensor(builds):
    model = _model(n_layers=3)
    positions = LocalPositions(cp=2, rank=1)
    ropes = [GlobalRope(layer.self_attn.rope_at, positions) for layer in model.layers]
    tables = [rope(8, 0, torch.float32) for rope in ropes]  # 8 local tokens: global 4..7 and 8..11 of 16
    assert builds == ["at"] and all(t is tables[0] for t in tables)
    expected = model.layers[0].self_attn.rotary.build_range(16, 0, torch.float32, torch.device("cpu"))[0]
    assert torch.equal(tables[0][0][0, 0], torch.cat([expected[4:8], expected[8:12]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_equals_the_rotate_half_form_bit_for_bit(dtype):
    """``rotate`` against tables with the first half of sin negated gives, bit for bit, transformers' form
    x·cos + (-x2, x1)·sin with the plain tables (the same products, each with the same sign)."""
    tables = RotaryTables(16, 10000.0)
    cos, signed = tables.build_range(5, 3, dtype, torch.device("cpu"))
    half = 8
    sin = torch.cat((signed[..., half:], signed[..., half:]), dim=-1)  # the plain sin (s, s)
    assert torch.equal(signed[..., :half], -signed[..., half:])
    x = torch.randn(2, 4, 5, 16).to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    assert torch.equal(rotate(x, cos, signed), x * cos + torch.cat((-x2, x1), dim=-1) * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_is_transformers_float32_form_bit_for_bit(dtype):
    """The norm (torch's rms_norm in float32, cast, then the weight) equals transformers' LlamaRMSNorm
    arithmetic (x.float() * rsqrt(mean(x²) + eps), cast, times the weight) bit for bit, gradients too."""
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(3, 7, 64).to(dtype).requires_grad_()
    xf = x.float()
    want = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    got = norm(x)
    assert torch.equal(got, want)
    g = torch.randn_like(got)
    want_grads = torch.autograd.grad(want, (x, norm.weight), g)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got, (x, norm.weight), g), want_grads,
                                                 strict=True))
