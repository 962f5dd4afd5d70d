"""The end of a step: the DP gradient reduction (and how much of it the backward hides), ZeRO's traffic and
the optimizer step, on catalogue GPUs and on a calibrated host."""

from __future__ import annotations

from plait.plan import eager
from plait.plan.config import Cluster, Layout
from plait.plan.memory import STATE_BYTES
from plait.plan.model import Model
from plait.plan.timing import collective

# Adam step: read fp32 master, m, v and grad (16 B), write master, m, v (12 B) and bf16 weight (2 B).
OPTIMIZER_TRAFFIC = 30.0
# plait's optimizer step in fp32 (plait.optim.build_optimizer), bytes per parameter when a profile did not time
# it (format 1): the global norm casts each gradient to float64 a chunk at a time (read 4, write 8, the dot
# reads 8), the clip scales the gradients (read + write 8), torch's fused AdamW reads p, g, m, v and writes
# p, m, v in one pass (28). Profiles of format >= 2 time the step itself (Section.optimizer_s_per_param).
EAGER_OPTIMIZER_TRAFFIC = 56.0
EAGER_OPTIMIZER_OPS = 6  # kernels per parameter tensor: the norm's reshape, cast, dot and sum; clip; AdamW


def dp_sync_time(model: Model, cluster: Cluster, layout: Layout, params_on_gpu: float) -> float:
    """Gradient synchronisation at the end of a step over dp·cp (Rajbhandari et al. 2020, §5): the sum of
    ``dp_sync_parts``."""
    return sum(dp_sync_parts(model, cluster, layout, params_on_gpu))


def dp_sync_parts(model: Model, cluster: Cluster, layout: Layout, params_on_gpu: float) -> tuple[float, float]:
    """(gradient reduction, updated weights' gather) over dp·cp: an all-reduce of fp32 gradients and no
    gather (no ZeRO); a reduce-scatter of them and an all-gather of the updated weights (ZeRO-1 and ZeRO-2
    as plait runs them and as Megatron-LM's distributed optimizer does: once per step, the reduction at each
    chunk's last backward, the gather in the optimizer step; bf16 weights on catalogue GPUs, fp32 on a
    calibrated host, plait train's default); nothing (ZeRO-3, plan-only: gradients and weights move every
    micro-batch, ``zero_per_microbatch``)."""
    n = layout.dp * layout.cp
    span = layout.tp * n
    if layout.zero == 0:
        return collective(cluster, "all_reduce", 4 * params_on_gpu, n, span), 0.0
    if layout.zero == 3:
        return 0.0, 0.0
    weight = 4 if cluster.profile is not None else 2
    return (collective(cluster, "reduce_scatter", 4 * params_on_gpu, n, span),
            collective(cluster, "all_gather", weight * params_on_gpu, n, span))


def dp_hidden(cluster: Cluster, backward: float) -> float:
    """Seconds of the DP gradient reduction that ``backward`` (the busiest rank's, which the reduction runs
    beside) hides. On catalogue GPUs all of it: the reduction runs on the network engines while the SMs
    compute. On a calibrated host none: the reduction's copies, sums and socket work run on the same cores
    the backward fills (plait calibrate gives every process its share of the cores), so the time moves but
    does not vanish. On a two-core host, pp2·dp2's ranks waited 10-55 ms per step for their last bucket's
    reduction, and the step ran 753 ms where the prediction with the reduction hidden said 695 (the
    all-reduce's curve, which is what is added, is 16 ms of that)."""
    return 0.0 if cluster.profile is not None else backward


def zero_per_microbatch(cluster: Cluster, layout: Layout, params_on_gpu: float) -> float:
    """Communication ZeRO-3 (plan-only) repeats every micro-batch: it reduce-scatters the fp32 gradients
    and gathers the bf16 weights in forward and again in backward. It overlaps compute (see ``estimate``).
    ZeRO-2 reduces once per step, as ZeRO-1 (``dp_sync_time``): nothing per micro-batch."""
    if layout.zero < 3:
        return 0.0
    n = layout.dp * layout.cp
    span = layout.tp * n
    out = collective(cluster, "reduce_scatter", 4 * params_on_gpu, n, span)
    return out + 2 * collective(cluster, "all_gather", 2 * params_on_gpu, n, span)


def optimizer_shards(layout: Layout) -> int:
    """Ranks that share each parameter's optimizer step: dp·cp under ZeRO (each updates its shard), else 1."""
    return layout.dp * layout.cp if layout.zero >= 1 else 1


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
        per_layer += 2 * (h * kv + (kv if model.bias else 0))
    if model.is_moe:
        per_layer += h * model.n_experts
    return float(layers * per_layer + (norm if layout.sequence_parallel and last else 0))


def tp_partial_time(model: Model, cluster: Cluster, layout: Layout, layers: int, last: bool) -> float:
    """Seconds of that sum: one all-reduce of the fp32 gradients over TP (under ZeRO of the reduced shard,
    1/(dp·cp) of them)."""
    shard = optimizer_shards(layout)
    return collective(cluster, "all_reduce", 4 * tp_partial_elements(model, layout, layers, last) / shard,
                      layout.tp)


def param_tensors(layers: int) -> int:
    """Parameter tensors of a rank holding ``layers`` layers, and the embedding, the final norm and the head."""
    return layers * eager.param_tensors_per_layer() + 3


def publish_time(cluster: Cluster, layout: Layout, params_on_gpu: float, layers: int = 0,
                 precision: str = "bf16") -> float:
    """ZeRO's publish of the updated weights beyond its all-gather (``plait.optim.masters.Masters.publish``):
    each rank zeroes a buffer of its shard and copies its masters in (its weight bytes written twice, 4 read
    per owned element), and copies the gathered buffer out into every parameter (its weight bytes read and
    written per parameter), at the memory bandwidth of every process streaming at once (on a calibrated
    host: the replicas publish together); plus a copy kernel per owned piece and per parameter tensor at
    the fixed cost of a forward-only kernel. The buffers hold the weights' dtype (``precision``). 0 without
    ZeRO. On a 2-core host, ``small`` at pp2·dp2 (3.0M parameters a rank, fp32): 5.5-7.8 ms a step beyond
    the all-gather, over two layouts and four ranks."""
    if layout.zero == 0:
        return 0.0
    shard = optimizer_shards(layout)
    weight = STATE_BYTES[precision][0]
    traffic = (2 * weight + 4) * params_on_gpu / shard + 2 * weight * params_on_gpu
    if cluster.profile is None:
        return traffic / cluster.gpu.memory_bandwidth
    sec = cluster.section
    tensors = param_tensors(layers)
    kernels = tensors / shard + tensors  # the pieces a rank owns (about its share of the tensors), the copies out
    return traffic / sec.memory_bandwidth + kernels * sec.op_overhead_s * sec.rates["elementwise"].forward_share


def optimizer_time(model: Model, cluster: Cluster, layout: Layout, params_on_gpu: float,
                   layers: int = 0) -> float:
    """The optimizer step over this GPU's (sharded) parameters of ``layers`` layers: Adam streams its state
    through memory; on a calibrated host plait's step as ``plait calibrate`` timed it, per parameter and per
    tensor it updates (under ZeRO a rank updates its pieces of 1/(dp·cp) of the tensors), or per parameter
    alone (older profiles); profiles of format 1: its bytes at the streaming bandwidth and a few kernels per
    parameter tensor."""
    shard = optimizer_shards(layout)
    if cluster.profile is None:
        return OPTIMIZER_TRAFFIC * params_on_gpu / shard / cluster.gpu.memory_bandwidth
    sec = cluster.section
    tensors = param_tensors(layers)
    if sec.optimizer_s_per_param > 0:  # timed by plait calibrate
        return (sec.optimizer_s_per_param * params_on_gpu + sec.optimizer_s_per_tensor * tensors) / shard
    return (EAGER_OPTIMIZER_TRAFFIC * params_on_gpu / shard / sec.memory_bandwidth
            + EAGER_OPTIMIZER_OPS * tensors * sec.op_overhead_s * sec.rates["elementwise"].forward_share)
