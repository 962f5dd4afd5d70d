"""Single-process checks of the plain MoE: routing, capacity, load-balancing loss, local dispatch, config."""

import pytest
import torch

import plait
from plait.experts.dispatch import dispatch_combine
from plait.models import Llama, LlamaConfig
from plait.models.moe import MoE, capacity_keep, load_balancing_loss, pop_aux_losses, route


def test_load_balancing_loss_by_hand():
    # one sequence of 2 tokens, 2 experts, top-1: both tokens to expert 0
    probs = torch.tensor([[[0.75, 0.25], [0.25, 0.75]]])
    expert = torch.tensor([[[0], [0]]])
    # f = [1, 0], P = [0.5, 0.5] -> E * sum f*P = 2 * 0.5 = 1.0 (Fedus et al. 2021 eq. 4)
    assert load_balancing_loss(probs, expert, 2).item() == pytest.approx(1.0)
    uniform = torch.full((3, 4, 4), 0.25)
    balanced = torch.tensor([0, 1, 2, 3]).view(1, 4, 1).expand(3, 4, 1)
    assert load_balancing_loss(uniform, balanced, 4).item() == pytest.approx(3.0)  # 1 per sequence


def test_capacity_keeps_first_choices_in_order():
    expert = torch.tensor([[[0, 1], [0, 1], [0, 2], [0, 1]]])  # [B=1, S=4, k=2], E=4
    keep = capacity_keep(expert, 4, capacity_factor=1.0)  # C = ceil(1*4*2/4) = 2 per expert
    assert keep[0, :, 0].tolist() == [True, True, False, False]  # expert 0: first two tokens only
    assert keep[0, :, 1].tolist() == [True, True, True, False]
    assert capacity_keep(expert, 4, None).all()


def test_topk_gates_renormalised_and_switch_gate_raw():
    logits = torch.randn(2, 5, 6)
    r2 = route(logits, 2, None, 0.0)
    assert torch.allclose(r2.gate.sum(-1), torch.ones(2, 5))
    r1 = route(logits, 1, None, 0.0)
    assert torch.allclose(r1.gate[..., 0], logits.softmax(-1).max(-1).values)


def test_local_dispatch_equals_expert_loop():
    torch.manual_seed(0)
    moe = MoE(16, 24, n_experts=5, top_k=2, capacity_factor=0.8)
    x = torch.randn(3, 7, 16, requires_grad=True)
    y_loop = moe(x)
    r = route(moe.gate(x), 2, 0.8, 0.0)
    y = dispatch_combine(x.flatten(0, 1), *(t.flatten(0, 1) for t in (r.expert, r.gate, r.keep)),
                         list(moe.experts), 5, 1, None)
    assert torch.allclose(y.view_as(x), y_loop, atol=1e-6)
    g_loop, = torch.autograd.grad(y_loop.square().sum(), x)
    g, = torch.autograd.grad(y.square().sum(), x)
    assert torch.allclose(g, g_loop, atol=1e-5)


def test_llama_moe_loss_includes_aux_and_layers_alternate():
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=4, n_heads=2, n_experts=4, top_k=2, moe_every=2,
                      aux_loss_coef=0.5, max_seq_len=8)
    model = Llama(cfg)
    assert [isinstance(layer.mlp, MoE) for layer in model.layers] == [False, True, False, True]
    tokens = torch.randint(0, 32, (3, 9))
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    logits = model(tokens[:, :-1])
    aux = pop_aux_losses(model) / 3
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert loss.item() == pytest.approx((ce + aux).item(), rel=1e-6)
    assert 0 < aux.item() <= 2 * 0.5 * 4  # two layers, each at most coef * E (all to one expert)
    loss.backward()
    assert model.layers[1].mlp.gate.weight.grad.abs().sum() > 0
    assert pop_aux_losses(model) is None  # popped: nothing left behind


@pytest.mark.parametrize("kw,needle", [
    (dict(n_experts=4, top_k=5), "top_k=5"), (dict(n_experts=0), "n_experts=0"),
    (dict(n_experts=4, capacity_factor=0.0), "capacity_factor"), (dict(n_experts=4, moe_every=0), "moe_every"),
])
def test_bad_moe_config(kw, needle):
    with pytest.raises(plait.ConfigError, match=needle):
        LlamaConfig(**kw)



@pytest.mark.parametrize("args,kw,needle", [
    ((8, 16, 2), dict(top_k=3), "top_k=3 must be between 1 and n_experts=2"),
    ((8, 16, 2), dict(top_k=0), "top_k=0"),  # would route no token: a zero output
    ((8, 16, 4), dict(capacity_factor=-1.0), "capacity_factor"), ((8, 16, 4), dict(aux_loss_coef=-1.0), "aux_loss"),
])
def test_bad_moe_layer_arguments(args, kw, needle):
    with pytest.raises(plait.ConfigError, match=needle):
        MoE(*args, **kw)


def test_moe_layer_routes_to_two_experts_by_default_with_mixtral_names():
    moe = MoE(8, 16, 4)
    assert moe.top_k == 2
    assert {k.split(".")[0] for k in moe.state_dict()} == {"gate", "experts"}
    assert "experts.3.down_proj.weight" in moe.state_dict() and moe(torch.randn(2, 3, 8)).shape == (2, 3, 8)


def test_expert_load_figures_by_hand():
    from plait.experts.load import ExpertLoad
    from plait.train.report import experts_text

    # layer 1: 6 assignments over 4 experts, the busiest has 3 (mean 1.5: 2x); layer 3: balanced, 2 dropped
    load = ExpertLoad(layers=["1", "3"], counts=[[3, 1, 2, 0], [2, 2, 2, 2]], dropped=[0, 2], aux_loss=0.25,
                      capped=True)
    assert load.imbalance() == [2.0, 1.0]
    assert load.dropped_fraction() == 2 / 16
    row = load.row()
    assert row == {"aux_loss": 0.25, "expert_imbalance": 2.0, "expert_imbalance_by_layer": {"1": 2.0, "3": 1.0},
                   "dropped_fraction": 0.125}
    assert experts_text(row) == " (aux 0.2500) | experts max/mean 2.00 (layer 1), dropped 12.5%"
    dropless = ExpertLoad(layers=["0"], counts=[[4, 0]], dropped=[0], aux_loss=0.5, capped=False).row()
    assert dropless["dropped_fraction"] is None  # no capacity: nothing can be dropped, none said
    assert experts_text(dropless) == " (aux 0.5000) | experts max/mean 2.00"
    assert experts_text({"loss": 1.0}) == ""  # a dense model's line is unchanged
