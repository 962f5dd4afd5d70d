"""The end of a step: the DP gradient reduction, ZeRO's traffic, the TP-partial gradients' sum and the optimizer
step, from the cluster's cost model."""

from __future__ import annotations

from plait.plan import experts
from plait.plan.cluster import Cluster
from plait.plan.config import GRAD_DTYPES, Layout
from plait.plan.memory import STATE_BYTES
from plait.plan.model import Model
from plait.plan.optimizers import RUNTIME_OPTIMIZER

#: parameter tensors of a Llama layer: seven projections and two norms
PARAM_TENSORS_PER_LAYER = 9

#: The ``Training.optimizer`` stacks whose ZeRO-1 all-reduces the gradients (and then all-gathers the updated
#: weights) where plait's reduce-scatters them. DeepSpeed's fp16 ZeRO stage 1 (microsoft/DeepSpeed v0.5.10 and
#: master of 2022-02-18, 2151c787; the same from v0.4.4, #1246, to v0.12): deepspeed/runtime/engine.py
#: _configure_zero_optimizer sets contiguous_gradients = False at stage 1 ("meaningless in stage 1"), so
#: zero/stage_1_and_2.py reduce_ipg_grads takes buffered_reduce_fallback(None, ...), whose allreduce_bucket runs
#: dist.all_reduce on each flattened 5e8-element bucket; step then all-gathers the updated fp16 partitions in
#: shards (dist.all_gather). The bucket's flatten, div_ and copies back (12 B an element through HBM) are not
#: charged.
ZERO1_ALL_REDUCE = frozenset({"deepspeed-zero-fp16"})


def groups(layout: Layout, params_on_gpu: float, expert: float = 0.0) -> tuple[tuple[float, int], ...]:
    """A rank's ``params_on_gpu`` parameters by the group their gradients are reduced over, and under ZeRO
    sharded over, as ``(elements, ranks)``: ``expert`` of them (an MoE model's experts) over the ranks that hold
    the same experts (``experts.dp_group``: ``data_parallel.reducer.set_grad_group``, buckets of their own), the
    rest over dp·cp. Both groups lie in the pipeline stage's plane of tp·dp·cp consecutive ranks."""
    dense = (params_on_gpu - expert, layout.dp * layout.cp)
    if expert <= 0:
        return (dense,)
    return dense, (expert, experts.dp_group(layout))


def dp_sync_time(model: Model, cluster: Cluster, layout: Layout, params_on_gpu: float,
                 grad_dtype: str = "fp32", expert: float = 0.0, optimizer: str = RUNTIME_OPTIMIZER) -> float:
    """Gradient synchronisation at the end of a step over dp·cp (Rajbhandari et al. 2020, §5): the sum of
    ``dp_sync_parts``."""
    return sum(dp_sync_parts(model, cluster, layout, params_on_gpu, grad_dtype, expert, optimizer))


def dp_sync_parts(model: Model, cluster: Cluster, layout: Layout, params_on_gpu: float,
                  grad_dtype: str = "fp32", expert: float = 0.0,
                  optimizer: str = RUNTIME_OPTIMIZER) -> tuple[float, float]:
    """(gradient reduction, updated weights' gather) over dp·cp, the gradients in ``grad_dtype``
    (``Training.grad_dtype``: fp32 as plait runs it, 2 B where the stack reduces 16-bit gradients): an
    all-reduce of the gradients and no gather (no ZeRO); a reduce-scatter of them and an all-gather of the
    updated weights (ZeRO-1 and ZeRO-2 as plait runs them and as Megatron-LM's distributed optimizer does: once
    per step, the reduction at each chunk's last backward, the gather after the optimizer step (or beside the
    next forwards: ``plan.overlap``); bf16 weights on catalogue GPUs, fp32 on a calibrated host, plait train's
    default); ZeRO-3 as plait runs it: the same reduce-scatter, of the last
    micro-batch's backward (each earlier one reduce-scatters its own: ``zero_per_microbatch``), and no gather
    after the step (each forward and backward gathers its blocks). Under ZeRO-1 an ``optimizer`` in
    ``ZERO1_ALL_REDUCE`` all-reduces the gradients before the same gather. The ``expert`` parameters of an MoE
    model go over their own group, a collective of their own (``groups``)."""
    if layout.zero == 3:
        return zero3_collectives(cluster, layout, params_on_gpu, zero3_units(model, layout), grad_dtype,
                                 expert)[1], 0.0
    span = layout.tp * layout.dp * layout.cp
    collective = cluster.costs.collective
    grad_bytes, weight_bytes = GRAD_DTYPES[grad_dtype], cluster.costs.weight_gather_bytes
    reduce = "all_reduce" if layout.zero == 0 or (layout.zero == 1 and optimizer in ZERO1_ALL_REDUCE) else \
        "reduce_scatter"
    reduction = gather = 0.0
    for elements, n in groups(layout, params_on_gpu, expert):
        reduction += collective(reduce, grad_bytes * elements, n, span)
        if layout.zero:
            gather += collective("all_gather", weight_bytes * elements, n, span)
    return reduction, gather


def zero3_units(model: Model, layout: Layout) -> int:
    """The blocks ZeRO-3 gathers and reduce-scatters one by one on the busiest rank (``ParamShards``): each of
    its layers, the embedding, the final norm and the head."""
    return -(-model.n_layers // layout.pp) + 3


def zero3_collectives(cluster: Cluster, layout: Layout, params_on_gpu: float,
                      units: int = 1, grad_dtype: str = "fp32", expert: float = 0.0) -> tuple[float, float]:
    """(the all-gathers of a rank's weights in the gather dtype, the reduce-scatters of its gradients in
    ``grad_dtype``: fp32 as plait runs it, 2 B for FSDP with a 16-bit ``reduce_dtype``) over
    dp·cp under ZeRO-3: what one pass gathers and one backward reduce-scatters (``zero_per_microbatch``), as
    ``units`` collectives of equal size (one per block: each pays the ring's latency, which over thousands of
    ranks outweighs a block's bytes); (0, 0) below ZeRO-3. The ``expert`` parameters of an MoE model are
    sharded over the ranks holding the same experts (``groups``), a bucket of their own in each layer's block:
    ``units - 3`` more collectives of each kind over that group (the embedding, final norm and head hold no
    experts; at least one)."""
    if layout.zero < 3:
        return 0.0, 0.0
    span = layout.tp * layout.dp * layout.cp
    units = max(1, units)
    costs = cluster.costs
    gather = scatter = 0.0
    for i, (elements, n) in enumerate(groups(layout, params_on_gpu, expert)):
        k = units if i == 0 else max(1, units - 3)
        gather += k * costs.collective("all_gather", costs.weight_gather_bytes * elements / k, n, span)
        scatter += k * costs.collective("reduce_scatter", GRAD_DTYPES[grad_dtype] * elements / k, n, span)
    return gather, scatter


def zero_per_microbatch(cluster: Cluster, layout: Layout, params_on_gpu: float, microbatches: int = 1,
                        units: int = 1, grad_dtype: str = "fp32", expert: float = 0.0) -> float:
    """Communication ZeRO-3 repeats every micro-batch (on average over the step's ``microbatches``): every
    block's weights are all-gathered for its forward and again for its backward
    (``plait.data_parallel.param_shards``), in the weights' gather dtype, and each backward reduce-scatters its
    gradients in ``grad_dtype`` (``plait.data_parallel.zero3_reducer``; the last micro-batch's is
    ``dp_sync_parts``'s, so (M-1)/M of one here). Each collective is issued a block ahead or behind the
    compute, so it overlaps it where the cost model says the network runs beside it (``estimate``). ZeRO-1/2:
    nothing per micro-batch."""
    gather, scatter = zero3_collectives(cluster, layout, params_on_gpu, units, grad_dtype, expert)
    return 2 * gather + scatter * (microbatches - 1) / microbatches


def optimizer_shards(layout: Layout) -> int:
    """Ranks that share each dense parameter's optimizer step: dp·cp under ZeRO (each updates its shard), else 1."""
    return layout.dp * layout.cp if layout.zero >= 1 else 1


def owned(layout: Layout, params_on_gpu: float, expert: float = 0.0) -> float:
    """Elements of a rank's ``params_on_gpu`` whose optimizer step it runs: all of them below ZeRO; under ZeRO
    its shard of each group's (``groups``: the ``expert`` ones over the ranks holding the same experts)."""
    if layout.zero < 1:
        return params_on_gpu
    return sum(elements / n for elements, n in groups(layout, params_on_gpu, expert))


def tp_partial_elements(model: Model, layout: Layout, layers: int, last: bool) -> float:
    """Elements of one rank's replicated parameters whose gradient each TP rank holds only part of, summed
    over TP once per step after the backward (``plait.tensor_parallel.layers.sum_over_tp``): under sequence
    parallelism the ``layers`` layers' norms (LayerNorm's biases too) and row-parallel biases, and on the
    ``last`` stage the final norm; the K and V projections where TP exceeds the KV heads (replicated); an
    MoE layer's router (each TP rank routes its own tokens)."""
    if layout.tp == 1:
        return 0.0
    h = model.hidden
    norm = h * (2 if model.layernorm else 1)
    per_layer = 0
    if layout.sequence_parallel:
        per_layer += 2 * norm + (2 * h if model.bias else 0)
    if layout.tp > model.kv_heads:
        kv = model.kv_heads * model.head_dim
        per_layer += 2 * (h * kv + (kv if model.bias or model.qkv_bias else 0))
    if model.is_moe:
        per_layer += h * model.n_experts
    return float(layers * per_layer + (norm if layout.sequence_parallel and last else 0))


def tp_partial_time(model: Model, cluster: Cluster, layout: Layout, layers: int, last: bool,
                    grad_dtype: str = "fp32") -> float:
    """Seconds of that sum: one all-reduce of the gradients (in ``grad_dtype``: they live in the gradient
    buffer) over TP (under ZeRO of the reduced shard, 1/(dp·cp) of them)."""
    shard = optimizer_shards(layout)
    nbytes = GRAD_DTYPES[grad_dtype] * tp_partial_elements(model, layout, layers, last) / shard
    return cluster.costs.collective("all_reduce", nbytes, layout.tp)


def tied_sum_time(model: Model, cluster: Cluster, layout: Layout, grad_dtype: str = "fp32",
                  where: str = "shard") -> float:
    """Seconds of the sum of a tied embedding's gradient over the first and last pipeline stages, which hold a
    copy each: one all-reduce over those two ranks once a step, after the backward and before the optimizer step
    (exposed), of the vocabulary shard's gradient (V·h/t elements) in ``grad_dtype``. ``where``
    (``Training.tied_grad_sum``): "shard" as plait's runtime sums it after the DP reduction, over the reduced
    elements (``plait.pipeline.ties``: 1/(dp·cp) of them under ZeRO); "full", the whole gradient, as Megatron-LM
    all-reduces the word embeddings' gradient over its embedding group after the DP all-reduce
    (NVIDIA/Megatron-LM megatron/training.py train_step at de7dc40f) and DeepSpeed's pipeline engine issues
    ReduceTiedGrads before ReduceGrads (microsoft/DeepSpeed deepspeed/runtime/pipe/schedule.py TrainSchedule,
    module.py allreduce_tied_weight_gradients at v0.5.10). The two stages are a pipeline apart: the ring spans
    the world. 0 without tied embeddings or a pipeline."""
    if not model.tied_embeddings or layout.pp == 1:
        return 0.0
    elements = model.vocab * model.hidden / layout.tp
    if where == "shard":
        elements /= optimizer_shards(layout)
    return cluster.costs.collective("all_reduce", GRAD_DTYPES[grad_dtype] * elements, 2, layout.world)


def param_tensors(layers: int) -> int:
    """Parameter tensors of a rank holding ``layers`` layers, and the embedding, the final norm and the head."""
    return layers * PARAM_TENSORS_PER_LAYER + 3


def publish_time(cluster: Cluster, layout: Layout, params_on_gpu: float, layers: int = 0,
                 precision: str = "bf16", optimizer: str = RUNTIME_OPTIMIZER, expert: float = 0.0) -> float:
    """ZeRO's publish of the updated weights beyond its all-gather (``plait.optim.masters.Masters.publish``):
    each rank zeroes a buffer of its shard and copies its masters in (its weight bytes written twice, 4 read
    per owned element), and copies the gathered buffer out into every parameter (its weight bytes read and
    written per parameter), at the memory bandwidth of every process streaming at once (on a calibrated
    host: the replicas publish together); plus a copy kernel per owned piece and per parameter tensor at
    the fixed cost of a forward-only kernel. The buffers hold the weights' dtype (``precision``). 0 without
    ZeRO, and under ZeRO-3 (the masters are the shards the next forward gathers). On a 2-core host,
    ``small`` at pp2·dp2 (3.0M parameters a rank, fp32): 5.5-7.8 ms a step beyond the all-gather, over two
    layouts and four ranks. 0 for another stack's ``optimizer``: its own copies are in its traffic
    (``plan.optimizers.OPTIMIZERS``). A rank owns its shard of each group's parameters (``owned``)."""
    if layout.zero in (0, 3) or optimizer != RUNTIME_OPTIMIZER or params_on_gpu <= 0:
        return 0.0
    own = owned(layout, params_on_gpu, expert)
    weight = STATE_BYTES[precision][0]
    traffic = (2 * weight + 4) * own + 2 * weight * params_on_gpu
    tensors = param_tensors(layers)
    kernels = tensors * own / params_on_gpu + tensors  # the pieces a rank owns (about its share), the copies out
    return cluster.costs.stream_time(traffic, kernels)


def optimizer_time(cluster: Cluster, layout: Layout, params_on_gpu: float, layers: int = 0,
                   optimizer: str = RUNTIME_OPTIMIZER, expert: float = 0.0) -> float:
    """The optimizer step, its gradient clipping included, over this GPU's (sharded) parameters of ``layers``
    layers (under ZeRO a rank updates its pieces of 1/(dp·cp) of the dense tensors and of 1/``experts.dp_group``
    of the ``expert`` ones: ``owned``) as ``optimizer`` (``Training.optimizer``) runs it:
    ``CostModel.optimizer_time``, its ``shards`` the ratio of held to owned elements."""
    own = owned(layout, params_on_gpu, expert)
    shards = params_on_gpu / own if expert > 0 and own > 0 else optimizer_shards(layout)
    return cluster.costs.optimizer_time(params_on_gpu, param_tensors(layers), shards, optimizer)
