"""Full recomputation on a calibrated host as plait's runtime runs it (torch's non-reentrant checkpoint stops before
a dense layer's last GEMM and its TP reduction, and runs the head's output layer and the embedding not at all): the
host model charges the layer's forward less that GEMM's share by the host's own figures and less the collective
after it (``HostCosts._not_recomputed``), the head its final norm (``HostCosts._head_recomputed``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from calibrated_util import MATMUL, host_cluster, host_section, tp_cluster, with_layers
from plait.models.llama import Llama, LlamaConfig
from plait.plan import Layout, Model, Training
from plait.plan.host import census
from plait.plan.host.compute import work_costs
from plait.plan.timing import layer_blocks

DENSE = Model(2, 64, 4, 512, 32, 96, 2, glu=True)
MOE = Model(2, 64, 4, 512, 32, 96, 2, glu=True, n_experts=4, top_k=2)
TOKENS = 2 * 32  # two sequences of 32


def charged(cluster, model, layout, early_stop):
    return layer_blocks(cluster.costs, model, layout, Training(8, recompute_early_stop=early_stop)).layer


def down_projection_share(model, layout, sec):
    """The MLP's second GEMM, [T, f/t] x [f/t, h] at the flat matmul rate, over the layer's forward by the same
    kernel figures."""
    sh = census.local(model, layout)
    forward = work_costs(census.layer_work(sh, 2), sec, False, layer=True).f_compute
    return 2 * TOKENS * model.hidden * model.ffn / layout.tp / MATMUL / forward


@pytest.mark.parametrize("measured", [False, True])
def test_a_dense_layer_recomputes_its_forward_less_its_last_gemm(measured):
    """``measured``: whole calibration layers set the forward's level in a step (1.5-2x the kernel figures) and
    its split with the backward; the share the GEMM takes of the forward is the kernel figures'."""
    sec = host_section(None)
    if measured:
        sec = with_layers(host_section((2e-4, 3e-3)), (1.5, 2.0), (1.5, 2.0))
    layout = Layout(microbatch_size=2, recompute="full")
    early, whole = (charged(host_cluster(sec), DENSE, layout, e) for e in (True, False))
    assert whole.recompute == pytest.approx(whole.f_compute)
    share = down_projection_share(DENSE, layout, sec)
    assert 0.05 < share < 0.5
    assert early.recompute == pytest.approx(early.f_compute * (1 - share), rel=1e-12)
    assert early.f_compute == whole.f_compute and early.b_compute == whole.b_compute


@pytest.mark.parametrize("sp", [False, True])
def test_a_tp_layer_recomputes_without_the_reduction_after_its_last_gemm(sp):
    """At tp2 the forward's TP collectives are two all-reduces (SP: two gathers and two reduce-scatters), each with
    its measured wait; the recomputation skips the one after the down projection."""
    wait = 2e-4
    cluster = tp_cluster({(2, sp): wait}, p=2)
    layout = Layout(tp=2, microbatch_size=2, recompute="full", sequence_parallel=sp)
    early, whole = (charged(cluster, DENSE, layout, e) for e in (True, False))
    n_bytes = census.local(DENSE, layout).n * 2
    reduction = cluster.costs.collective("reduce_scatter" if sp else "all_reduce", n_bytes, 2) + wait
    assert whole.recompute == pytest.approx(whole.f_compute + whole.f_tp)
    share = down_projection_share(DENSE, layout, cluster.costs.section)
    assert early.recompute == pytest.approx(early.f_compute * (1 - share) + early.f_tp - reduction, rel=1e-12)
    assert reduction > 0 and early.f_tp == whole.f_tp


def test_an_moe_layer_and_other_recomputations_are_unchanged():
    """An MoE layer's router weighting saves its experts' outputs: its forward runs whole again. Selective and no
    recomputation do not depend on the flag."""
    cluster = host_cluster(host_section(None))
    full = Layout(microbatch_size=2, recompute="full")
    early, whole = (charged(cluster, MOE, full, e) for e in (True, False))
    assert early.recompute == whole.recompute == pytest.approx(whole.f_compute)
    for recompute in ("selective", "none"):
        layout = Layout(microbatch_size=2, recompute=recompute)
        assert charged(cluster, DENSE, layout, True) == charged(cluster, DENSE, layout, False)


class Kernels(TorchDispatchMode):
    """The ops torch runs while active, views and detaches left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] not in ("view", "_unsafe_view", "detach", "t"):
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def recomputed_ops(block: torch.nn.Module, x: torch.Tensor) -> int:
    """How many more kernels the backward of ``block`` runs under plait's checkpoint than without it."""
    counts = []
    for checkpointed in (True, False):
        block.zero_grad(set_to_none=True)
        x.grad = None
        y = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        with Kernels() as k:
            y.float().sum().backward()
        counts.append(len(k.ops))
    return counts[0] - counts[1]


def test_plaits_head_recomputes_its_final_norm_only():
    """The embedding, final norm and output layer are blocks of their own (``models.decoder``), each checkpointed:
    the norm runs again, the output layer's GEMM and the lookup do not."""
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=32, vocab_size=128, n_layers=1)
    llama = Llama(cfg)
    x = torch.randn(1, 32, 64, requires_grad=True)
    assert recomputed_ops(llama.norm, x) == 5  # pow, mean, +eps, rsqrt, ·rsqrt: all but its last, ·weight
    assert recomputed_ops(llama.lm_head, x) == 0
    assert recomputed_ops(llama.embed_tokens, torch.randint(0, 128, (1, 32))) == 0


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)])
def test_the_host_charges_the_head_its_final_norm_and_the_embedding_nothing(tp, sp):
    """The head's recomputation is the final norm's share of its forward by the host's kernel figures (under SP also
    the output layer's gather of its input, with its wait); the loss's collectives are outside the checkpoints."""
    wait = 2e-4
    cluster = tp_cluster({(2, sp): wait}, p=2) if tp > 1 else host_cluster(host_section(None))
    layout = Layout(tp=tp, microbatch_size=2, recompute="full", sequence_parallel=sp)
    early, whole = (layer_blocks(cluster.costs, DENSE, layout, Training(8, recompute_early_stop=e))
                    for e in (True, False))
    sh, sec = census.local(DENSE, layout), cluster.costs.section
    norm = work_costs(census.final_norm_work(sh, 2), sec, False).f_compute
    share = norm / work_costs(census.head_work(sh, 2), sec, False).f_compute
    gather = cluster.costs.collective("all_gather", sh.n * 2, tp) + wait if sp else 0.0
    assert 0 < share < 0.5
    assert early.head.recompute == pytest.approx(early.head.f_compute * share + gather, rel=1e-12)
    assert whole.head.recompute == pytest.approx(whole.head.f_compute + whole.head.f_tp)
    assert early.embedding.recompute == 0.0 < whole.embedding.recompute
