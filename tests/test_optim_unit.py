"""plait.optim without processes: LR schedule, weight-decay groups, configuration errors."""

import math

import pytest
import torch

from plait import ConfigError
from plait.models import Llama, LlamaConfig
from plait.optim import ParallelOptimizer, check_precision, lr_at, param_groups


def test_lr_warmup_then_cosine():
    assert lr_at(0, 1.0, warmup=4, total_steps=10) == pytest.approx(0.25)
    assert lr_at(3, 1.0, warmup=4, total_steps=10) == pytest.approx(1.0)
    assert lr_at(4, 1.0, warmup=4, total_steps=10) == pytest.approx(1.0)  # cosine starts at the peak
    mid = 4 + 3  # half-way through the decay: (1 + min) / 2
    assert lr_at(mid, 1.0, warmup=4, total_steps=10, min_ratio=0.1) == pytest.approx(0.55)
    assert lr_at(10, 1.0, warmup=4, total_steps=10, min_ratio=0.1) == pytest.approx(0.1)
    assert lr_at(50, 1.0, warmup=4, total_steps=10, min_ratio=0.1) == pytest.approx(0.1)  # clamped
    assert lr_at(7, 2.0) == 2.0  # no warm-up, no decay
    values = [lr_at(k, 1.0, 2, 20) for k in range(2, 21)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert not any(math.isnan(v) for v in values)


def test_no_decay_on_norms_and_biases():
    model = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8))
    model.layers[0].mlp.up_proj.bias = torch.nn.Parameter(torch.zeros(model.config.ffn_dim))
    named = dict(model.named_parameters())
    decay, plain = param_groups(model.named_parameters(), 0.1)
    assert decay["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    plain_names = {k for k, p in named.items() if any(p is q for q in plain["params"])}
    assert plain_names == {k for k in named if "norm" in k or k.endswith(".bias")}
    assert len(decay["params"]) + len(plain["params"]) == len(named)


@pytest.mark.parametrize("kw,needle", [
    ({"zero": 4}, r"zero=4: plait.optim supports 0, 1, 2, 3 "), ({"zero": True}, "zero=True: .* supports 0, 1, 2, 3"),
    ({"zero": 2, "reduce_scatter": False}, "zero=2"),
    ({"lr": -1}, r"lr=-1: the learning rate must be a finite number >= 0"), ({"lr": float("nan")}, "lr=nan"),
    ({"lr": "3e-4"}, "lr='3e-4'"),
    ({"weight_decay": -0.1}, r"weight_decay=-0.1: must be a finite number >= 0"),
    ({"clip": 0.0}, r"clip=0.0: .* > 0 .* or None"), ({"clip": -1.0}, "clip=-1.0"),
    ({"clip": float("inf")}, "clip=inf"),
    ({"warmup": -1}, r"warmup=-1: .* int >= 0"), ({"warmup": 2.5}, "warmup=2.5"),
    ({"total_steps": 0}, r"total_steps=0: .* int >= 1, or None"),
    ({"min_lr_ratio": 1.5}, r"min_lr_ratio=1.5: .* in \[0, 1\]"), ({"min_lr_ratio": -0.1}, "min_lr_ratio=-0.1")])
def test_bad_optimizer_arguments(kw, needle):
    """Each argument out of range is a ConfigError naming it and its valid values, raised before the model is
    touched (None here: nothing of it is read) and so before any collective."""
    with pytest.raises(ConfigError, match=needle):
        ParallelOptimizer(None, **kw)


def test_bad_precision():
    assert check_precision("bf16") == "bf16"
    with pytest.raises(ConfigError, match="precision"):
        check_precision("fp8")


@pytest.mark.parametrize("fused", [False, True])
def test_square_sum_is_the_float64_sum_of_squares(monkeypatch, fused):
    """Both ways of summing the gradients' squares (the fused per-dtype norm, the float64 chunks) give the float64
    sum of squares of every element, whatever the tensors' dtypes, sizes (one spanning several chunks) or emptiness.
    ``fused`` runs the fused branch through torch's generic ``_foreach_norm`` on this CPU."""
    from plait.optim import optimizer

    monkeypatch.setattr(optimizer, "NORM_CHUNK", 1000)
    if fused:
        monkeypatch.setattr(optimizer, "FUSED_NORM_DEVICES", ("cuda", "cpu"))
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(2500, generator=g) * 3, torch.randn(7, 5, generator=g).bfloat16(), torch.zeros(0),
             torch.randn(64, generator=g).double()]
    want = sum(float((t.double() ** 2).sum()) for t in grads)
    got = optimizer.square_sum(grads)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert float(got) == pytest.approx(want, rel=1e-13)
    assert float(optimizer.square_sum([])) == 0.0


def test_early_copies_hand_each_bucket_over_when_its_backward_ends():
    """A bucket reduced over other ranks (``StepCast.route``'s ``early``) gets its bf16 gradients from leaf
    copies as soon as its layer's backward ends, before the earlier layer's backward; the shared node of the
    other buckets hands them over after the whole backward. Both hand over the same gradients, bit for bit, and
    leave no ``.grad`` on the copies."""
    from torch import nn

    from plait.optim.precision import StepCast

    torch.manual_seed(0)
    chunk = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(4, 8)
    events: list[str] = []
    got: dict[str, list] = {}

    def sink(name):
        return lambda grads: (events.append(name), got.setdefault(name, []).append([g.clone() for g in grads]))

    cast = StepCast({0: chunk}, "bf16")
    groups = [(list(chunk[1].parameters()), sink("last layer")), (list(chunk[0].parameters()), sink("first layer"))]

    copies: dict[str, torch.Tensor] = {}

    def step() -> None:  # as the executor runs a step: forward and backward inside ``run``
        copies.update(cast.copies)
        h = chunk[0](x.bfloat16())
        h.register_hook(lambda g: events.append("between"))
        chunk[1](h).float().sum().backward()

    orders = []
    for early in (frozenset(), frozenset({0, 1})):
        cast.route(groups, early)
        events.clear()
        copies.clear()
        cast.run(step)
        orders.append(list(events))
        assert all(c.grad is None for c in copies.values() if c.is_leaf)
    assert orders == [["between", "first layer", "last layer"], ["last layer", "between", "first layer"]]
    for name, (shared, leaf) in got.items():
        assert all(torch.equal(a, b) for a, b in zip(shared, leaf, strict=True)), name


@pytest.mark.parametrize("zero", [0, 1])
def test_clip_in_the_constructor_clips_at_step_and_keeps_the_norm_in_last_norm(zero):
    """``ParallelOptimizer(pm, cls, ..., clip=c)``; ``pm.zero_grad(); pm.train_step(x, y); opt.step()``: torch's
    update after ``clip_grad_norm_(c)``, and ``opt.last_norm`` the norm it measured (one rank). SGD: its update is
    the clipped gradient itself (Adam's would hide a wrong scale: it divides it out)."""
    import plait

    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8)
    torch.manual_seed(0)
    ref = Llama(cfg)
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    with plait.init(tp=1, pp=1, dp=1) as ctx:
        pm = plait.parallelize(Llama(cfg), ctx)
        pm.load_full_state_dict(ref.state_dict())
        opt = ParallelOptimizer(pm, torch.optim.SGD, lr=1.0, weight_decay=0.0, zero=zero, clip=0.1)
        assert opt.last_norm is None
        pm.zero_grad()
        pm.train_step(x, y)
        opt.step()
        after = pm.full_state_dict()
    ref.loss(x, y).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1))
    torch.optim.SGD(ref.parameters(), lr=1.0, weight_decay=0.0).step()
    assert norm > 0.1 and opt.last_norm == pytest.approx(norm, rel=1e-5)  # clipping was active
    for k, v in ref.state_dict().items():
        assert torch.allclose(after[k], v, rtol=1e-5, atol=1e-7), k


def test_an_optimizer_replaced_by_a_newer_one_for_the_same_model_refuses_to_step():
    """A second ParallelOptimizer for a model sets how train_step reduces its gradients (zero=1: each data-parallel
    rank keeps the sum of its shard only): stepping the first (zero=0, which reads whole gradients) after it would
    give wrong weights on dp=2, and different ones on each replica, so it refuses, naming both; the newer one steps."""
    import plait

    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8)
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    with plait.init(tp=1, pp=1, dp=1) as ctx:
        pm = plait.parallelize(Llama(cfg), ctx)
        first = ParallelOptimizer(pm, torch.optim.SGD, lr=0.1, zero=0)
        newer = ParallelOptimizer(pm, torch.optim.SGD, lr=0.1, zero=1, clip=1.0)
        pm.train_step(tokens[:, :-1], tokens[:, 1:])
        for call in (first.step, first.grad_norm):
            with pytest.raises(ConfigError, match=r"this ParallelOptimizer \(zero=0\) is no longer the model's: one "
                                                  r"made for the same model since \(zero=1\)"):
                call()
        assert newer.step() is not None and pm.attached_optimizer is newer
