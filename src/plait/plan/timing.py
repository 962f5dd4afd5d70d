"""Time model: the FLOPs of a model, and the per-micro-batch costs of every pipeline chunk and rank from a cluster's
cost model (``plan.costs.CostModel``; the end of a step, DP reduction and optimizer: ``plan.step_end``)."""

from __future__ import annotations

from dataclasses import replace

from plait.plan.config import TE_OVERLAP_SMS, Layout
from plait.plan.costs import CostModel, StageCosts
from plait.plan.model import Model
from plait.plan.stages import layout_stages


def layer_forward_flops(model: Model, tokens: float, seq_len: float) -> float:
    """Forward FLOPs of one layer over ``tokens`` tokens: 2 per weight of every matmul a token
    uses (active experts only) plus attention's QK^T and AV, 4·s·h per token (Narayanan et al.
    2021, eq. 2; counted without causal savings as there)."""
    matmul = model.layer_params(active=True) - 2 * model.norm_params()
    return 2 * tokens * matmul + 4 * tokens * seq_len * model.hidden


def head_forward_flops(model: Model, tokens: float) -> float:
    return 2 * tokens * model.hidden * model.vocab


def model_flops_per_step(model: Model, global_batch: int) -> float:
    """Model FLOPs of one step, forward + backward (3×forward), no recomputation: the MFU numerator
    (Chowdhery et al. 2022, App. B)."""
    tokens = global_batch * model.seq_len
    fwd = model.n_layers * layer_forward_flops(model, tokens, model.seq_len)
    return 3 * (fwd + head_forward_flops(model, tokens))


def chunk_costs(costs: CostModel, model: Model, layout: Layout, precision: str = "bf16",
                recompute_head: bool = True, tp_overlap: bool = False,
                overlap_sms: tuple[int, int] = TE_OVERLAP_SMS) -> list[StageCosts]:
    """Per-micro-batch costs of every pipeline chunk (its layers, the embedding on chunk 0, the head on
    the last), in the runtime's cut; without ``recompute_head`` (``Training.recompute_head``) the head's
    recomputation is not charged; ``tp_overlap``: ``Training.tp_comm_overlap``, ``overlap_sms``:
    ``Training.tp_overlap_sms``."""
    blocks = costs.blocks(model, layout, precision, tp_overlap, overlap_sms)
    if not recompute_head:
        blocks = replace(blocks, head=replace(blocks.head, recompute=0.0))
    st = layout_stages(model, layout)
    p2p = costs.p2p(model, layout, precision)
    last = len(st.chunk_layers) - 1
    made: dict[tuple[int, bool, bool], StageCosts] = {}  # chunks come in a few sizes: cost each once
    out = []
    for c, n in enumerate(st.chunk_layers):
        key = (n, c == 0, c == last)
        if key not in made:
            cost = blocks.layer.times(n)
            if c == 0:
                cost = cost + blocks.embedding
            if c == last:
                cost = cost + blocks.head
            made[key] = StageCosts(cost.f_compute, cost.b_compute, cost.w_compute, cost.f_tp, cost.b_tp,
                                   cost.recompute, p2p, n)
        out.append(made[key])
    return out


def rank_costs(costs: CostModel, model: Model, layout: Layout, precision: str = "bf16",
               recompute_head: bool = True, tp_overlap: bool = False,
               overlap_sms: tuple[int, int] = TE_OVERLAP_SMS) -> list[StageCosts]:
    """Per-micro-batch costs of every pipeline rank: the sum of its chunks."""
    placement = layout_stages(model, layout).placement
    out = [StageCosts() for _ in range(layout.pp)]
    for c, cost in enumerate(chunk_costs(costs, model, layout, precision, recompute_head, tp_overlap,
                                         overlap_sms)):
        out[placement[c]] = out[placement[c]] + cost
    return out
