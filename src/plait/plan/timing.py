"""Time model: the FLOPs of a model, and the per-micro-batch costs of every pipeline chunk and rank from a cluster's
cost model (``plan.costs.CostModel``; the end of a step, DP reduction and optimizer: ``plan.step_end``)."""

from __future__ import annotations

from dataclasses import replace

from plait.plan import experts
from plait.plan.accumulation import AccumulationTraffic, traffic
from plait.plan.config import Layout, Training
from plait.plan.costs import Blocks, CostModel, StageCosts
from plait.plan.memory import rank_params
from plait.plan.model import Model
from plait.plan.stages import layout_stages


def layer_forward_flops(model: Model, tokens: float, seq_len: float) -> float:
    """Forward FLOPs of one layer over ``tokens`` tokens: 2 per weight of every matmul a token
    uses (active experts only) plus attention's QK^T and AV, 4·s·h per token (Narayanan et al.
    2021, eq. 2; counted without causal savings as there), h the query heads' width (``Model.q_width``)."""
    matmul = model.layer_params(active=True) - model.layer_norm_params()
    return 2 * tokens * matmul + 4 * tokens * seq_len * model.q_width


def head_forward_flops(model: Model, tokens: float) -> float:
    return 2 * tokens * model.hidden * model.vocab


def model_flops_per_step(model: Model, global_batch: int) -> float:
    """Model FLOPs of one step, forward + backward (3×forward), no recomputation: the MFU numerator
    (Chowdhery et al. 2022, App. B). A layer with a sliding window shorter than the sequence attends each query
    to ``sliding_window`` keys, not ``seq_len``: counted over the sequence, its attention would be FLOPs the model
    does not define (a 4k window at 128k tokens: 32 times its own), and the MFU could pass 100%."""
    tokens = global_batch * model.seq_len
    windowed = round(model.window_layer_share * model.n_layers)
    fwd = (model.n_layers - windowed) * layer_forward_flops(model, tokens, model.seq_len)
    if windowed:
        assert model.sliding_window is not None  # window_layer_share is 0 without one
        fwd += windowed * layer_forward_flops(model, tokens, model.sliding_window)
    return 3 * (fwd + head_forward_flops(model, tokens))


def accumulation_bytes(model: Model, layout: Layout, layers: int, first: bool, last: bool,
                       acc: AccumulationTraffic, microbatches: int) -> float:
    """HBM bytes of one backward's weight-gradient accumulation (``plan.accumulation``) on one GPU of a chunk of
    ``layers`` layers (``first``: with the embedding, ``last``: with the head), on average over the step's
    ``microbatches``: per element it holds, and per element of its gradient shard (1/(dp·cp) of the dense
    elements, 1/``experts.dp_group`` of the experts')."""
    dense, expert = rank_params(model, layout, layers, first, last)
    if acc.fused:  # only what no GEMM produces: the norms, the embedding table
        dense = layers * model.layer_norm_params() + (model.embedding_params() / layout.tp if first else 0.0) + (
            model.norm_params() if last else 0.0)
        expert = 0.0
    later = (microbatches - 1) / microbatches
    shard = dense / (layout.dp * layout.cp) + (expert / experts.dp_group(layout) if expert else 0.0)
    held = dense + expert
    return held * (acc.every + acc.later * later) + shard * (acc.shard_every + acc.shard_later * later)


def layer_blocks(costs: CostModel, model: Model, layout: Layout, training: Training) -> Blocks:
    """``costs.blocks`` of ``layout`` as ``training``'s stack runs a layer (see ``chunk_costs``), its attention as
    document masking runs it where ``training`` says how the documents cut the rows (``Training.documents``)."""
    t = training
    return costs.blocks(model, layout, t.precision, t.tp_comm_overlap, t.tp_overlap_sms, t.elementwise,
                        t.sp_async_backward, t.recompute_early_stop, t.documents if t.document_mask else None)


def chunk_costs(costs: CostModel, model: Model, layout: Layout, training: Training | None = None,
                microbatches: int = 1, blocks: Blocks | None = None) -> list[StageCosts]:
    """Per-micro-batch costs of every pipeline chunk (its layers, the embedding on chunk 0, the head on
    the last), in the runtime's cut, as ``training``'s stack runs a layer (None: plait's runtime, ``Training``'s
    defaults): its ``precision``; without ``recompute_head`` the head's recomputation is not charged;
    ``tp_comm_overlap``, ``tp_overlap_sms`` and ``sp_async_backward`` for the TP collectives, ``elementwise`` for
    its element-wise kernels (``CostModel.blocks``). Each backward also accumulates the chunk's weight gradients
    as ``grad_accumulation`` runs it over ``microbatches``: its hooks and kernels run on the GPU as each gradient
    is produced, so they lengthen that backward (and the W pass of split-backward schedules) on the pipeline's
    critical path, charged in ``b_compute`` and ``w_compute`` (``CostModel.accumulation_time``). ``blocks``: this
    layout's ``layer_blocks`` when the caller has them (None: found here)."""
    t = training if training is not None else Training(1)
    precision = t.precision
    if blocks is None:
        blocks = layer_blocks(costs, model, layout, t)
    if not t.recompute_head:
        blocks = replace(blocks, head=replace(blocks.head, recompute=0.0))
    st = layout_stages(model, layout)
    p2p = costs.p2p(model, layout, precision)
    acc = traffic(t.grad_accumulation, precision, layout.zero)
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
            grads = costs.accumulation_time(accumulation_bytes(model, layout, *key, acc, microbatches),
                                            t.grad_accumulation)
            made[key] = StageCosts(cost.f_compute, cost.b_compute + grads, cost.w_compute + grads, cost.f_tp,
                                   cost.b_tp, cost.recompute, p2p, n)
        out.append(made[key])
    return out


def rank_costs(costs: CostModel, model: Model, layout: Layout, training: Training | None = None,
               microbatches: int = 1) -> list[StageCosts]:
    """Per-micro-batch costs of every pipeline rank: the sum of its chunks."""
    placement = layout_stages(model, layout).placement
    out = [StageCosts() for _ in range(layout.pp)]
    for c, cost in enumerate(chunk_costs(costs, model, layout, training, microbatches)):
        out[placement[c]] = out[placement[c]] + cost
    return out


def layer_gemms(model: Model, layout: Layout) -> tuple[tuple[float, float, float, float], ...]:
    """The forward GEMMs of one layer on one GPU for one micro-batch, ``(m, n, k, count)``: an [m, k] by [k, n]
    product, ``count`` of them, in Megatron-LM's tensor-parallel cut (Shoeybi et al. 2019, §3) over the T tokens
    of a micro-batch on this rank (s/cp of each sequence; sequence parallelism gathers them before each GEMM):
    the fused QKV projection [T, h] x [h, (q + 2kv)/t] (KV heads replicated where t exceeds them), the output
    projection [T, q/t] x [q/t, h] (q: ``Model.q_width``), the MLP's first GEMM [T, h] x [h, f/t] (gate and up
    fused with a GLU: 2f/t) and its second [T, f/t] x [f/t, h]. A mixture-of-experts layer runs each of its E/ep
    experts on the tokens routed to it, whole or split over TP (``experts.gemms``). The router and biases are left
    out (their FLOPs take the layer's mean)."""
    t = layout.tp
    tokens = layout.microbatch_size * model.seq_len / layout.cp
    h, d = model.hidden, model.head_dim
    qkv = (model.n_heads / t + 2 * max(model.kv_heads / t, 1.0)) * d
    attention = ((tokens, qkv, h, 1.0), (tokens, h, model.q_width / t, 1.0))
    if model.is_moe:
        return attention + experts.gemms(model, layout, tokens)
    return attention + ((tokens, model.ffn * (2 if model.glu else 1) / t, h, 1.0), (tokens, h, model.ffn / t, 1.0))


def recomputed_gemms(model: Model, layout: Layout, early_stop: bool) -> tuple[tuple[float, float, float, float], ...]:
    """The GEMMs of ``layer_gemms`` that a full recomputation runs again. An early-stopping one (torch's
    non-reentrant checkpoint from torch 2.1: ``Training.recompute_early_stop``) ends as the forward's last saved
    tensor is saved again, and an op saves its inputs before its kernel runs: a dense layer's last GEMM (the
    MLP's second) is followed by nothing that saves a tensor (its TP reduction, the residual add), so it is not
    run again; an MoE layer scales each expert's output by its router weight and adds it in by index, which save
    them, so all of its GEMMs are."""
    gemms = layer_gemms(model, layout)
    return gemms[:-1] if early_stop and not model.is_moe else gemms


def head_gemm(model: Model, layout: Layout) -> tuple[float, float, float, float]:
    """The output layer's GEMM on one GPU, [T, h] x [h, V/t] (vocabulary-parallel)."""
    tokens = layout.microbatch_size * model.seq_len / layout.cp
    return tokens, model.vocab / layout.tp, model.hidden, 1.0
