"""What full recomputation runs again, as plait's runtime checkpoints a block (``pipeline.partition``:
``checkpoint(block, x, use_reentrant=False)``), against what the planner charges for it
(``timing.recomputed_gemms``, ``GpuCosts.blocks``): the GEMMs torch runs in the backward of a checkpointed block,
less those of the same block's backward without the checkpoint, are the GEMMs recomputed."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from plait.models.llama import DecoderLayer, LlamaConfig
from plait.plan import Cluster, Layout, Model, Training
from plait.plan.gemm import gemm_seconds
from plait.plan.timing import layer_blocks, layer_gemms, recomputed_gemms

GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
TOKENS = 32  # one sequence of 32 tokens


class GemmFlops(TorchDispatchMode):
    """FLOPs of every mm / addmm / bmm torch runs while active, and the SDPA calls."""

    def __init__(self) -> None:
        super().__init__()
        self.flops, self.attention = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            a, b = (args[1], args[2]) if func is torch.ops.aten.addmm.default else (args[0], args[1])
            self.flops += 2 * a.numel() * b.shape[-1]
        elif "scaled_dot_product" in func.__name__ and "backward" not in func.__name__:
            self.attention += 1
        return func(*args, **(kwargs or {}))


def backward_flops(block: torch.nn.Module, checkpointed: bool, reentrant: bool = False) -> tuple[int, int]:
    """(GEMM FLOPs, forward attention calls) torch runs in the backward of one block over ``TOKENS`` tokens."""
    torch.manual_seed(0)
    x = torch.randn(1, TOKENS, block.input_layernorm.weight.numel(), requires_grad=True)
    y = checkpoint(block, x, use_reentrant=reentrant) if checkpointed else block(x)
    with GemmFlops() as counted:
        y.sum().backward()
    return counted.flops, counted.attention


def recomputed_flops(block: torch.nn.Module, reentrant: bool = False) -> tuple[int, int]:
    """The GEMM FLOPs and attention calls recomputing ``block`` adds to its backward."""
    with_ck, attention = backward_flops(block, True, reentrant)
    without, plain = backward_flops(block, False)
    return with_ck - without, attention - plain


def planned_flops(model: Model, early_stop: bool) -> float:
    layout = Layout(microbatch_size=1, recompute="full")
    return sum(2 * m * n * k * count for m, n, k, count in recomputed_gemms(model, layout, early_stop))


DENSE = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=TOKENS)
MOE = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=TOKENS, n_experts=4, top_k=2)


def test_plaits_dense_block_recomputes_all_but_its_last_gemm_as_planned():
    """plait's checkpoint stops before the MLP's down projection: it re-runs the q/k/v, output, gate and up
    projections and the attention core, which is the planner's early-stopping recomputation; a reentrant
    checkpoint (other stacks') re-runs the block whole, which is the planner's without early stop."""
    torch.manual_seed(0)
    block, model = DecoderLayer(DENSE), Model.from_llama_config(DENSE, seq_len=TOKENS)
    flops, attention = recomputed_flops(block)
    assert attention == 1
    assert flops == planned_flops(model, early_stop=True)
    last = layer_gemms(model, Layout(microbatch_size=1))[-1]
    assert last == (TOKENS, DENSE.dim, DENSE.ffn_dim, 1.0)  # the down projection
    whole, _ = recomputed_flops(block, reentrant=True)
    assert whole == planned_flops(model, early_stop=False) == flops + 2 * TOKENS * DENSE.dim * DENSE.ffn_dim


def test_plaits_moe_block_recomputes_every_gemm_as_planned():
    """An MoE layer weights each expert's output by its router weight (a multiply that saves it) and adds it in
    by index: nothing is skipped. The planner leaves the router's GEMM out of a layer's GEMMs; the experts' rows
    are every token's top_k (dropless), however they were routed."""
    torch.manual_seed(0)
    block, model = DecoderLayer(MOE), Model.from_llama_config(MOE, seq_len=TOKENS)
    flops, attention = recomputed_flops(block)
    router = 2 * TOKENS * MOE.dim * MOE.n_experts
    assert attention == 1
    assert flops - router == pytest.approx(planned_flops(model, early_stop=True), rel=1e-9)
    assert planned_flops(model, early_stop=True) == planned_flops(model, early_stop=False)


@pytest.mark.parametrize("tp", [1, 4])
def test_an_early_stopping_plan_charges_less_recomputation_for_a_dense_layer_only(tp):
    """On catalogue GPUs the layer's recomputation loses its last GEMM (and after it the TP reduction), the
    head's its GEMM; an MoE layer's is unchanged; without full recomputation nothing differs."""
    cluster = Cluster("h100-sxm", 8)
    dense = Model.preset("llama3-8b", seq_len=2048)
    moe = Model(4, 4096, 32, 32000, 2048, 14336, 8, glu=True, n_experts=8, top_k=2)
    layout = Layout(tp=tp, dp=8 // tp, recompute="full", sequence_parallel=tp > 1)
    on, off = Training(64), Training(64, recompute_early_stop=False)
    early, whole = (layer_blocks(cluster.costs, dense, layout, t) for t in (on, off))
    assert early.layer.recompute < whole.layer.recompute < 1.01 * whole.layer.forward + whole.layer.f_tp
    assert early.head.recompute == 0.0 < whole.head.recompute
    m, n, k, _ = layer_gemms(dense, layout)[-1]
    skipped, gemm = whole.layer.recompute - early.layer.recompute, gemm_seconds(cluster.gpu, m, n, k)
    if tp > 1:  # the down projection's reduce-scatter is skipped with it
        assert skipped > 1.01 * gemm
    else:
        assert skipped == pytest.approx(gemm, rel=1e-12)
    moe_early, moe_whole = (layer_blocks(cluster.costs, moe, layout, t) for t in (on, off))
    assert moe_early.layer.recompute == moe_whole.layer.recompute
    none = Layout(tp=tp, dp=8 // tp, sequence_parallel=tp > 1)
    assert layer_blocks(cluster.costs, dense, none, on) == layer_blocks(cluster.costs, dense, none, off)


def test_plait_runs_only_an_early_stopping_recomputation():
    """A plan with the other stacks' whole-block recomputation is not what plait's runtime runs."""
    from plait.errors import ConfigError

    with pytest.raises(ConfigError, match="recompute_early_stop"):
        Layout(recompute="full").to_parallel_config(Training(8, recompute_early_stop=False))
    with pytest.raises(ConfigError, match="recompute_early_stop"):
        Training(8, recompute_early_stop="yes")  # type: ignore[arg-type]
