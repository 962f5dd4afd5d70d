"""Memory model: model states by precision and ZeRO stage, Korthikanti et al.'s activation count, every rank's total
(the activations of a cluster come from its cost model: ``plan.gpu`` or ``plan.host``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from plait.plan import experts
from plait.plan.config import GRAD_DTYPES, LOSSES, Layout, Training
from plait.plan.documents import DocumentBytes, with_documents
from plait.plan.model import Model
from plait.plan.optimizers import RUNTIME_MASTERS
from plait.plan.stages import layout_stages, stages

if TYPE_CHECKING:
    from plait.plan.cluster import Cluster

# Bytes per parameter of (weights, gradients, optimizer state). "bf16": mixed-precision Adam as Megatron-LM
# runs it (Micikevicius et al. 2018; Rajbhandari et al. 2020, "ZeRO", §3.1): bf16 weights (2 B), fp32
# gradient accumulators (4 B, main_grad), fp32 master weights and two fp32 moments (12 B). "fp32": plait
# train's default, fp32 weights (the masters themselves) and gradients and AdamW's two moments (8 B). plait's own
# bf16 runs keep fp32 weights without ZeRO (``Training.masters``, ``state_bytes``).
# ZeRO-1 shards the optimizer state (12 B ÷ d with bf16, masters included; 8 B ÷ d with fp32), ZeRO-2 also
# the gradients left after the step, ZeRO-3 also the weights, over the data-parallel (× context-parallel)
# group. ZeRO-2 reduce-scatters once per step, at each chunk's last backward (plait's runtime; see
# ``rank_memory``): while the backward runs the full fp32 gradient buffer is there, beside the activations.
# Stacks that keep a 16-bit gradient buffer (``Training.grad_dtype``) hold 2 B instead of 4 below ZeRO-3:
# ZeRO's own count (Rajbhandari et al. 2020, §3.1 and Figure 1: (2 + 2 + K)Ψ, fp16 parameters and gradients);
# Megatron-Core's DDP allocates its buffer in the parameters' dtype unless ``grad_reduce_in_fp32``
# (NVIDIA/Megatron-LM megatron/core/distributed/distributed_data_parallel.py at ee6737da: ``grad_dtype =
# torch.float if self.ddp_config.grad_reduce_in_fp32 else param.dtype``).
STATE_BYTES = {"bf16": (2, 4, 12), "fp32": (4, 4, 8)}
WEIGHT_BYTES = STATE_BYTES["bf16"][0]
ACTIVATION_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class Memory:
    """Bytes on one GPU (pipeline rank ``rank``; the most loaded unless said), and what the planner lets it
    use. ``total`` is the step's peak: the model states, the activations at their peak and what the step holds
    beside them there that autograd does not save (``weight_copies``, ``loss_backward``)."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    total: float
    rank: int
    usable: float
    working: float = 0.0  # of ``activations``: held once (a recomputed layer, gathered ZeRO-3 weights)
    grads_after_step: float | None = None  # ZeRO-2: the shards left once the step's gradients are reduced
    weight_copies: float = 0.0  # plait's per-step bf16 copies of the weights (``step_transients``)
    loss_backward: float = 0.0  # the loss's backward beside the activations at their peak (``step_transients``)

    @property
    def grads_held(self) -> float:
        """Gradient bytes after the step (what ``pm.memory_report()`` reports then): ``grads`` unless ZeRO-2."""
        return self.grads if self.grads_after_step is None else self.grads_after_step

    @property
    def fits(self) -> bool:
        return self.total <= self.usable


def stage_layers(model: Model, pp: int, virtual: int = 1, schedule: str = "1f1b") -> tuple[int, ...]:
    """Decoder layers per pipeline rank: the runtime's balanced cut (``pipeline.balance``), the head
    charged to the last chunk; surplus layers come off the first chunks (see ``plan.stages``)."""
    return stages(model, pp, virtual, schedule).rank_layers


def activation_bytes_per_layer(model: Model, layout: Layout, micro: int | None = None) -> float:
    """Activation bytes one layer stores for one micro-batch (Korthikanti et al. 2022, §4).

    The paper's per-layer count for GPT (MHA, 4h GELU MLP, 16-bit, dropout) is
    ``sbh(34 + 5as/h)`` without parallelism, ``sbh(10 + 24/t + 5as/(ht))`` with TP and
    ``sbh(34/t + 5as/(ht))`` with TP+SP. Its terms, generalised to GQA (g = kv/heads) and GLU MLPs:
    replicated 10 = 2 norm inputs (4) + QKV and MLP inputs (4) + 2 dropout masks (2); TP-sharded
    attention (4 + 4g)·q/h (Q, K, V, projection input; q the query heads' width, ``Model.q_width``, h unless a
    config gives its head size apart), MLP 2·(f/h)·k (k = 2 GELU tensors, 3 for GLU);
    score term 5as/h (softmax output 2, dropout mask 1, dropout output 2). Without dropout
    (``Model.dropout``) the masks and the dropout output are not there: replicated 8, scores 2as/h.
    Selective recomputation drops the scores; full keeps the 2sbh layer input.
    Context parallelism (plait.context_parallel): s is a rank's S/cp tokens, and no score is kept (its
    attention recomputes probabilities from the log-sum-exp); the all-gather mode also keeps the other ranks'
    K and V: 4·(cp-1)·(a_kv·d/h)/t, a_kv the KV heads and d the head size.
    An MoE layer's MLP term is its experts' on the top_k rows of each token, times the rows a GPU's experts
    receive over balanced routing's (``experts.received``).
    """
    b = micro or layout.microbatch_size
    s, h, t = model.seq_len / layout.cp, model.hidden, layout.tp
    g = model.kv_heads / model.n_heads
    k = 3 if model.glu else 2
    mlp = 2 * (model.ffn / h) * k * (model.top_k * experts.received(model, layout) if model.is_moe else 1)
    sharded = (4 + 4 * g) * model.q_width / h + mlp
    replicated = 10.0 if model.dropout else 8.0
    score = (5 if model.dropout else 2) * model.n_heads * model.seq_len / h  # s·s/cp: local queries, all keys
    sbh = s * b * h
    if layout.recompute == "full":
        return 2 * sbh / (t if layout.sequence_parallel else 1)
    body = (replicated + sharded) / t if layout.sequence_parallel else replicated + sharded / t
    if layout.recompute == "none" and layout.cp == 1:
        body += score / t
    if layout.cp > 1 and layout.cp_comm == "allgather":
        body += 4 * (layout.cp - 1) * (model.kv_heads * model.head_dim / h) / t
    return sbh * body


@dataclass(frozen=True)
class ActivationModel:
    """Bytes per micro-batch of one layer, of the first chunk's embedding and of the last chunk's head,
    plus a working set held once (a recomputed layer, gathered ZeRO-3 weights) and ``shared``: what autograd
    saves once per rank for all its layers and micro-batches (the RoPE tables the layers share); ``documents``:
    what document masking adds to a micro-batch (``plan.documents``)."""

    layer: float
    first: float
    last: float
    working: float
    shared: float = 0.0
    documents: DocumentBytes | None = None

    def chunk(self, layers: int, first: bool, last: bool) -> float:
        """Bytes one micro-batch leaves on a chunk of ``layers`` layers until its backward."""
        docs = self.documents.chunk(layers) if self.documents is not None else 0.0
        return layers * self.layer + (self.first if first else 0.0) + (self.last if last else 0.0) + docs


# Bytes per logit the loss holds at its peak (``Training.loss``), beyond the head's 4sbh/t. "fp32-logits": the
# float32 logits kept for the backward (Korthikanti et al. 2022, §4.3: 4sbv/t). "torch-cross-entropy": torch's
# ``cross_entropy(logits.float(), labels)`` as torchtitan's train.py calls it (pytorch/torchtitan train.py at
# 9dec370, ``loss_fn``; ``del pred`` before ``loss.backward()``): log_softmax keeps its float32 output (4 B) and its
# backward, called with nll_loss's dense float32 gradient (4 B), writes a float32 result (4 B) while both live.
# "megatron-vocab-parallel": Megatron-Core's vocab-parallel cross-entropy, unfused or its 'native' fusion
# (NVIDIA/Megatron-LM megatron/core/tensor_parallel/cross_entropy.py and fusions/fused_cross_entropy.py at
# ee6737da): it makes a float32 copy of the 16-bit logits (calculate_logits_max) while GPTModel.forward still holds
# those (2 + 4 B), turns the copy into the softmax in place and keeps it; its backward writes the gradient into the
# softmax in place and returns a bf16 copy of it (4 + 2 B).
LOGIT_BYTES = {"fp32-logits": 4, "torch-cross-entropy": 12, "megatron-vocab-parallel": 6}


def torchtitan_op_layer(model: Model, layout: Layout) -> float:
    """Bytes one layer keeps for one micro-batch under torchtitan's per-op selective checkpointing
    (pytorch/torchtitan torchtitan/parallelisms/parallelize_llama.py at 9dec370, ``_apply_ac_to_transformer_block``
    with ``selective_ac_option = 'op'``): the checkpointed block keeps its input (2sbh) and the outputs of the ops
    in ``_save_list`` — every other ``aten.mm`` in the block's order (the 1st, 3rd, ...: of a Llama block's wq, wk,
    wv, wo, w1, w3, w2 that is wq, wv, w1 and w2), and the flash attention's output (2sbh) and float32 log-sum-exp
    (4·s·b·a); all else is recomputed in the backward. One GPU of a data-parallel group: no TP or CP split."""
    tokens = model.seq_len * layout.microbatch_size
    q, kv, f, h = model.n_heads * model.head_dim, model.kv_heads * model.head_dim, model.ffn, model.hidden
    mms = [q, kv, kv, h] + ([f, f, h] if model.glu else [f, h])  # the block's matmul outputs in forward order
    kept = sum(mms[0::2]) + h + q  # + the block's input + the attention's output, 2 B an element
    return tokens * (2 * kept + 4 * model.n_heads)


def activations(cluster: Cluster, model: Model, layout: Layout, training: Training) -> ActivationModel:
    """The cluster's activation count (``CostModel.activations``) with ``training``'s stack: another selective
    policy's layer (``Training.selective_policy``; ``config.check`` keeps it to tp = cp = 1) and the loss's bytes
    per logit (``Training.loss``), and what document masking adds (``Training.document_mask``)."""
    acts = cluster.costs.activations(model, layout, training.precision, training.elementwise)
    if training.document_mask:
        acts = with_documents(acts, model, layout, ACTIVATION_BYTES[training.precision])
    if training.selective_policy == "torchtitan-op" and layout.recompute == "selective":
        acts = replace(acts, layer=torchtitan_op_layer(model, layout))
    if layout.zero == 3 and training.zero3_impl == "torchtitan-fsdp2":
        acts = replace(acts, working=acts.working - zero3_working(model, layout, training.precision)
                       + fsdp2_working(model, layout))
    extra = LOGIT_BYTES[training.loss] - LOGIT_BYTES["fp32-logits"]
    if extra:
        acts = replace(acts, last=acts.last + extra * model.seq_len / layout.cp * layout.microbatch_size
                       * model.vocab / layout.tp)
    return acts


def zero3_working(model: Model, layout: Layout, precision: str = "bf16", rank: int | None = None) -> float:
    """ZeRO-3's gathered working set as plait runs it (``plait.data_parallel.param_shards``) on pipeline rank
    ``rank`` (None: the most over the ranks): a block gathered for its forward or backward while the next one's
    gather is in flight, so the largest two neighbouring blocks of one of the rank's chunks — the embedding and the
    first layer, two layers, or the final norm and the head (the embedding's weights when tied, without a
    pipeline) — in the compute dtype (bf16 weights are gathered as bf16). A chunk keeps its last block after a
    forward only when its backward runs next, so no block stays gathered while other forwards run, whatever the
    schedule; prefetches stay inside a chunk."""
    if layout.zero != 3:
        return 0.0
    layer = sum(rank_params(model, layout, 1, False, False))
    embedding = sum(rank_params(model, layout, 0, True, False))
    head = sum(rank_params(model, layout, 0, False, True))  # under a pipeline with the tied copy of its own
    if layout.pp == 1 and model.tied_embeddings:  # the head's block gathers the embedding's weights
        head += embedding
    st = layout_stages(model, layout)
    norm, last = model.norm_params(), len(st.chunk_layers) - 1  # the final norm, a block of its own before the head
    pair = [0.0] * layout.pp
    for c, n in enumerate(st.chunk_layers):
        blocks = [embedding] * (c == 0) + [layer] * n + [norm, head - norm] * (c == last)
        pairs = [x + y for x, y in zip(blocks, blocks[1:], strict=False)] or blocks
        pair[st.placement[c]] = max(pair[st.placement[c]], *pairs)
    return STATE_BYTES[precision][0] * (max(pair) if rank is None else pair[rank])


def fsdp2_working(model: Model, layout: Layout) -> float:
    """Gathered weights (bf16) held at the activation peak (the loss's backward) under FSDP2 as torchtitan wraps
    it (``Training.zero3_impl = "torchtitan-fsdp2"``): the root group (the embedding, the final norm and the
    output layer) is gathered at the step's first forward and not freed until the end of the backward (torch's
    FSDP2 ``FSDPState._lazy_init``: "For the root, do not reshard after forward", its ``post_forward_mesh_info``
    set to None), and the last block is not freed after its forward either (pytorch/torchtitan
    torchtitan/parallelisms/parallelize_llama.py at 9dec370, ``apply_fsdp``: ``reshard_after_forward =
    int(layer_id) < len(model.layers) - 1``); every other block is freed after its forward."""
    root = sum(rank_params(model, layout, 0, True, True))
    return STATE_BYTES["bf16"][0] * (root + sum(rank_params(model, layout, 1, False, False)))


def rank_params(model: Model, layout: Layout, layers: int, first: bool, last: bool) -> tuple[float, float]:
    """(dense, expert) parameters held by one GPU of a pipeline rank with ``layers`` layers (``first``: it
    holds the embedding; ``last``: the final norm and the head)."""
    t = layout.tp
    expert_layer = model.n_experts * model.mlp_params() if model.is_moe else 0
    # replicated on every TP rank: the norms (under SP their gradients are summed; the per-head norms' weights
    # are a head's) and an MoE layer's router (``ExpertParallelMoE.gate``, its gradient a TP partial sum)
    replicated = model.layer_norm_params() + model.router_params()
    kv_bias = 1 if model.bias or model.qkv_bias else 0
    kv = 2 * (model.hidden + kv_bias) * model.head_dim * model.kv_heads  # the K and V weights (and biases)
    # fewer KV heads than TP ranks: every rank keeps the whole K and V weights and uses its group's head
    # (plait's ReplicatedHeadsLinear; their gradients are summed over TP)
    kv_local = kv if t > model.kv_heads else kv / t
    dense = layers * ((model.layer_params() - expert_layer - replicated - kv) / t + replicated + kv_local)
    if first:
        dense += model.embedding_params() / t
    if last:
        dense += (model.head_params() - model.norm_params()) / t + model.norm_params()
        if model.tied_embeddings and layout.pp > 1:
            dense += model.vocab * model.hidden / t  # the last stage keeps its own copy for the head
    return dense, layers * experts.held(model, layout)  # whole experts, or split over TP (``plan.experts``)


def max_rank_split(model: Model, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameters of the GPU that holds the most (dense + expert)."""
    st = layout_stages(model, layout)
    layers = st.rank_layers
    kinds = {(layers[r], r == st.first_rank, r == st.last_rank)
             for r in {st.first_rank, st.last_rank, max(range(layout.pp), key=layers.__getitem__)}}
    return max((rank_params(model, layout, *k) for k in kinds), key=sum)


def max_rank_params(model: Model, layout: Layout) -> float:
    """The most parameters (dense + expert) any GPU holds."""
    return sum(max_rank_split(model, layout))


def state_bytes(model: Model, layout: Layout, layers: int, first: bool, last: bool,
                precision: str = "bf16", grad_dtype: str = "fp32", masters: str = "apart") -> tuple[float, ...]:
    """(weights, grads, optimizer) bytes of one GPU, with ZeRO sharding over dp·cp (experts over the ranks that
    hold them, ``experts.dp_group``); gradients below ZeRO-3 in
    ``grad_dtype`` (``Training.grad_dtype``). ZeRO-3 as plait runs it keeps one float32 shard of the weights,
    which is also the master (no 16-bit copy between steps): 4 B of weights, 4 B of gradient and 8 B of
    moments per owned element in either precision (``data_parallel.param_shards``). 16 B an owned element is
    also what ZeRO-3 with a 16-bit gradient keeps (2 + 2 + 12: Rajbhandari et al. 2020, Figure 1's P_os+g+p)
    and what FSDP keeps whatever its ``reduce_dtype`` (its sharded gradient takes the float32 shard's dtype),
    so ``grad_dtype`` changes only ZeRO-3's traffic (``plan.step_end``). bf16 without ZeRO as plait's runtime
    runs it (``masters="plait"``, ``Training.masters``) keeps float32 parameters, their own masters: 4 + 4 + 8 B."""
    dense, expert = rank_params(model, layout, layers, first, last)
    group = layout.dp * layout.cp
    eg = experts.dp_group(layout) if model.is_moe else 1  # the ranks holding the same experts
    plait_replicated = precision == "bf16" and masters == RUNTIME_MASTERS and layout.zero == 0
    w, g, o = STATE_BYTES[precision] if layout.zero < 3 and not plait_replicated else (4, 4, 8)
    if layout.zero < 3:
        g = GRAD_DTYPES[grad_dtype]

    def shard(stage: int) -> float:
        return dense / group + expert / eg if layout.zero >= stage else dense + expert

    return w * shard(3), g * shard(2), o * shard(1)


def step_transients(model: Model, layout: Layout, layers: int, first: bool, last: bool, precision: str = "bf16",
                    masters: str = "apart", loss: str = LOSSES[0]) -> tuple[float, float]:
    """(weight copies, loss backward): bytes plait's runtime (``masters="plait"``, ``Training.masters``) holds on one
    GPU of a pipeline rank with ``layers`` layers beside the activations at their peak, which autograd's saved
    tensors (the activations, as ``pm.memory_report()`` measures them) do not count; (0, 0) for other stacks.

    Weight copies: under bf16 without ZeRO ``plait.optim.precision.StepCast`` casts every floating-point parameter
    to one bf16 copy when the step starts and holds it until the step's backward has ended: 2 B a parameter the
    rank holds. (ZeRO-1/2 store the parameters in bf16 and ZeRO-3 gathers them: no copy; fp32 computes on them.)

    Loss backward, on the rank holding the head: plait's cross-entropy (``plait.tensor_parallel.loss``, the
    runtime's ``Training.loss``) saves the float32 softmax, 4 B a logit of the micro-batch (counted in the
    activations, ``LOGIT_BYTES``); its backward, the first of the micro-batch's backward, runs while every tensor
    the micro-batch saved is still held and adds a float32 clone of the softmax (4 B), that gradient scaled by
    the loss's (4 B) and, under bf16, its cast back to the logits' dtype (2 B), all three alive at once. The
    forward's own transients (the logits beside their float32 shift) are no more. With one micro-batch in flight
    at the loss (one stage; the last stage of 1F1B and GPipe) the activations peak there; elsewhere (interleaved
    chunks, a recomputed layer's working set) the sum is an upper bound."""
    if masters != RUNTIME_MASTERS:
        return 0.0, 0.0
    copies = 0.0
    if precision == "bf16" and layout.zero == 0:
        copies = WEIGHT_BYTES * sum(rank_params(model, layout, layers, first, last))
    backward = 0.0
    if last and loss == LOSSES[0]:
        logits = model.seq_len / layout.cp * layout.microbatch_size * model.vocab / layout.tp  # [b·s/cp, V/t]
        backward = (4 + 4 + (ACTIVATION_BYTES[precision] if precision != "fp32" else 0)) * logits
    return copies, backward


def rank_memory(model: Model, cluster: Cluster, layout: Layout, peak: list[float], acts: ActivationModel,
                precision: str = "bf16", microbatches: int = 2, grad_dtype: str = "fp32",
                zero3_impl: str = "plait", masters: str = "apart", loss: str = LOSSES[0]) -> list[Memory]:
    """Memory of every pipeline rank at its activation peak; ``peak[r]`` is the most activation bytes rank r
    holds at once (from the simulated schedule, ``plan.pipeline``, of the chunks' bytes in ``acts``: ``activations``),
    its working set and shared tensors added once.

    ZeRO-2 as plait runs it reduce-scatters each bucket once per step, at the chunk's last backward, and frees
    the full buffer then: from a chunk's first backward of the step to its last the whole fp32 gradient is
    there, and with more than one micro-batch that spans the activation peak (a forward that follows a
    backward), so ``grads`` is the full buffer; ``grads_after_step`` the shards. With one micro-batch the peak
    comes before any gradient and buckets are freed as the backward frees activations: the shards are counted.
    ZeRO-3 reduce-scatters every block in every backward as its gradients complete
    (``plait.data_parallel.zero3_reducer``): the shards at the peak, whatever the micro-batches. Gradients in
    ``grad_dtype`` (``state_bytes``). FSDP2 as torchtitan runs it (``zero3_impl="torchtitan-fsdp2"``) with one
    micro-batch holds no gradient at the peak: its train loop frees the gradients before each forward
    (pytorch/torchtitan train.py at 9dec370: ``optimizers.zero_grad()``, torch's ``set_to_none=True``) and FSDP2
    sets each block's sharded gradient only at that block's post-backward reduce-scatter (``foreach_reduce``),
    after the loss's backward, where the activations peak; the shards are ``grads_after_step``. ``masters``:
    ``Training.masters``; with ``loss`` (``Training.loss``) they set what plait's step holds beside the
    activations (``step_transients``)."""
    st = layout_stages(model, layout)
    usable = cluster.usable_memory
    full_at_peak = layout.zero == 2 and microbatches > 1
    none_at_peak = layout.zero == 3 and zero3_impl == "torchtitan-fsdp2" and microbatches == 1
    out = []
    for r, layers in enumerate(st.rank_layers):
        first, last = r == st.first_rank, r == st.last_rank
        w, g, o = state_bytes(model, layout, layers, first, last, precision, grad_dtype, masters)
        after = g if layout.zero >= 2 else None
        if none_at_peak:
            g = 0.0
        if full_at_peak:
            g = state_bytes(model, replace(layout, zero=1), layers, first, last, precision, grad_dtype, masters)[1]
        working = acts.working
        if layout.zero == 3 and zero3_impl == "plait" and layout.pp > 1:  # this rank's gathered blocks
            working += zero3_working(model, layout, precision, r) - zero3_working(model, layout, precision)
        act = peak[r] + acts.shared + working
        copies, backward = step_transients(model, layout, layers, first, last, precision, masters, loss)
        out.append(Memory(w, g, o, act, w + g + o + act + copies + backward, r, usable, working, after, copies,
                          backward))
    return out
