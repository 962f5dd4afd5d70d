"""The planner's inputs: a parallel layout and a training workload, with their checks against a model and cluster."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.errors import ConfigError, FieldError
from plait.parallel_config import CP_COMMS, PRECISIONS, RECOMPUTE_MODES, ZERO3_SCHEDULES, ZERO_LEVELS, ParallelConfig
from plait.pipeline.balance import PARTITIONS, partition_layers
from plait.plan import experts
from plait.plan.accumulation import ACCUMULATIONS, RUNTIME_ACCUMULATION
from plait.plan.documents import DocumentLengths, check_documents
from plait.plan.eager import ELEMENTWISE
from plait.plan.model import Model
from plait.plan.optimizers import MASTERS, OPTIMIZERS, RUNTIME_OPTIMIZER, masters_gap
from plait.schedules import SCHEDULE_NAMES

if TYPE_CHECKING:
    from plait.plan.cluster import Cluster

#: schedules that place exactly two chunks per rank in a V (virtual_stages = 2 by construction)
V_SCHEDULES = ("zbv", "dualpipev")
#: schedules that take any number of chunks per rank (zb-h1 with more than one: ZB1P)
LOOPED_SCHEDULES = ("interleaved-1f1b", "looped-bfs", "zb-h1")

#: The values of the Layout fields that plait's runtime (plait.parallelize, plait train) runs — one table for
#: both sides: ``search`` emits only these (unless asked for plan-only layouts) and
#: ``Layout.to_parallel_config`` refuses the others. The planner also models ZeRO-3 under schedules with a split
#: backward (zero-bubble), which the runtime does not run (plan-only). The other fields (tp, pp, dp, cp and cp_comm,
#: ep, virtual_stages, micro-batch size, sequence parallelism) run at every value ``check`` accepts.
RUNTIME: dict[str, tuple] = {
    "recompute": RECOMPUTE_MODES,
    "zero": ZERO_LEVELS,  # ZeRO-3 under schedules without a split backward only (runtime_gap)
    "schedule": SCHEDULE_NAMES,
    "partition": ("balanced",),  # plait train cuts balanced (plait.parallelize takes the others)
}


@dataclass(frozen=True)
class Layout:
    """A parallel layout as the planner costs it: ``plait.ParallelConfig``'s layout fields, spelt as there, the layers'
    cut over the pipeline chunks and the micro-batch size (``to_parallel_config`` and ``from_parallel_config`` convert).
    world = tp·cp·dp·pp; ranks ordered tp (innermost), cp, dp, pp. Unlike ParallelConfig, ``dp`` is always given, and
    the planner models what the runtime does not run (``runtime_gap``)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (stages)."""
    dp: int = 1
    """Data-parallel size."""
    cp: int = 1
    """Context-parallel size (ranks splitting every sequence)."""
    cp_comm: str = "allgather"
    """How CP ranks exchange keys and values: allgather or ring (plait.context_parallel)."""
    ep: int = 1
    """Expert-parallel size (inside the dp·cp·tp plane of a stage; ``plan.experts``)."""
    expert_tp: bool = False
    """Split each expert over TP (else each GPU holds whole experts and dispatches 1/tp of the tokens): the
    runtime's ``ParallelConfig.expert_tp``, costed in ``plan.experts``."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (2 for zbv and dualpipev)."""
    microbatch_size: int = 1
    """Sequences per micro-batch (the micro-batch count follows from the global batch: ``microbatches``)."""
    sequence_parallel: bool = False
    """Shard norms and residuals along the sequence between TP regions."""
    recompute: str = "none"
    """Activation recomputation: none, selective or full."""
    zero: int = 0
    """ZeRO stage 0-3 (sharded over dp·cp)."""
    schedule: str = "1f1b"
    """Pipeline schedule (``plait.schedules.SCHEDULE_NAMES``)."""
    partition: str | tuple[int, ...] = "balanced"
    """How the decoder layers are cut into the pp·virtual_stages chunks (``pipeline.balance.partition_layers``):
    "balanced" (plait's runtime: the smallest most-loaded chunk, the embedding and head counted), "uniform" (equal
    counts, the surplus on the last chunks: Megatron-LM's and Megatron-Core's default, DeepSpeed's
    ``type:transformer``), or the layer counts per chunk."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep", "virtual_stages", "microbatch_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        for name, choices in (("recompute", RECOMPUTE_MODES), ("cp_comm", CP_COMMS), ("schedule", SCHEDULE_NAMES)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name}: {getattr(self, name)!r} is not one of {', '.join(choices)}")
        if self.zero not in ZERO_LEVELS:
            raise ConfigError(f"zero: must be one of {', '.join(map(str, ZERO_LEVELS))}, got {self.zero!r}")
        if self.schedule in V_SCHEDULES and self.virtual_stages != 2:
            raise ConfigError(f"virtual_stages: schedule {self.schedule} needs virtual_stages=2, "
                              f"got {self.virtual_stages}")
        if isinstance(self.partition, list):  # layer counts read back from JSON (``Estimate.to_dict``)
            object.__setattr__(self, "partition", tuple(self.partition))
        if isinstance(self.partition, str) and self.partition not in PARTITIONS:
            raise ConfigError(f"partition: {self.partition!r} is not one of {', '.join(PARTITIONS)} (or layer counts "
                              f"per chunk)")
        if not isinstance(self.partition, str) and not isinstance(self.partition, tuple):
            raise ConfigError(f"partition: give {', '.join(PARTITIONS)} or a tuple of layer counts, got "
                              f"{self.partition!r}")
        if self.virtual_stages > 1 and self.schedule not in LOOPED_SCHEDULES + V_SCHEDULES:
            raise ConfigError(f"virtual_stages: {self.virtual_stages} needs one of "
                              f"{', '.join(sorted(LOOPED_SCHEDULES + V_SCHEDULES))}")

    @classmethod
    def from_parallel_config(cls, parallel: ParallelConfig, microbatch_size: int = 1) -> Layout:
        """The layout of a resolved ``parallel`` (dp known) at ``microbatch_size`` sequences per micro-batch.
        Without a pipeline the schedule only orders gradient accumulation: it is costed as 1F1B; sequence
        parallelism needs tp > 1 to change anything."""
        par = parallel
        schedule, virtual = (par.schedule, par.pipeline_schedule().virtual) if par.pp > 1 else ("1f1b", 1)
        return cls(tp=par.tp, pp=par.pp, dp=par.dp, cp=par.cp, cp_comm=par.cp_comm, ep=par.ep,
                   expert_tp=par.expert_tp and par.tp > 1, virtual_stages=virtual, microbatch_size=microbatch_size,
                   sequence_parallel=par.sequence_parallel and par.tp > 1, recompute=par.recompute, zero=par.zero,
                   schedule=schedule)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def to_parallel_config(self, training: Training | None = None, precision: str | None = None,
                           rounds: str | None = None) -> ParallelConfig:
        """The runtime's configuration of this layout (``plait.parallelize(..., config=...)``, ``plait train``).

        ``training`` sets the micro-batches (``microbatches(layout, training)``) and the precision (without it:
        ``precision``, default bf16); ``rounds`` the interleaved rounds the estimate chose (``Estimate.rounds``).
        ConfigError for what the runtime does not run: ZeRO-3 under a pipeline (``runtime_gap``); a ``training``
        of another ``precision``, whose masters plait keeps otherwise (``masters_gap``), that leaves the head out
        of full recomputation, or sets an ``OTHER_STACKS`` field to another stack's value."""
        if gap := runtime_gap(self):
            raise ConfigError(gap)
        if training is not None and precision not in (None, training.precision):
            raise ConfigError(f"precision: {precision!r} is asked for but {training.precision!r} is planned (Training."
                              f"precision): leave precision unset to run what is planned, or plan with {precision!r}")
        precision = precision or (training.precision if training is not None else "bf16")
        if training is not None and self.recompute == "full" and not training.recompute_head:
            raise ConfigError("recompute_head: False is planned but plait's runtime recomputes the head under full "
                              "recomputation too (plan with recompute_head=True)")
        for name, runtime, does in OTHER_STACKS if training is not None else ():
            if (value := getattr(training, name)) != runtime:
                raise ConfigError(f"{name}: {value!r} is planned but plait's runtime {does} "
                                  f"(plan with {name}={runtime!r})")
        if training is not None and (gap := masters_gap(training.masters, training.precision, self.zero)):
            raise ConfigError(gap)
        return ParallelConfig(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp, cp_comm=self.cp_comm, ep=self.ep,
                              expert_tp=self.expert_tp, schedule=self.schedule,
                              microbatches=microbatches(self, training) if training is not None else None,
                              virtual_stages=self.virtual_stages, sequence_parallel=self.sequence_parallel,
                              recompute=self.recompute, zero=self.zero, precision=precision, rounds=rounds)

    def short(self) -> str:
        """A compact label, e.g. ``tp8 pp4 dp2 v2 mb1 sp sel z1 interleaved-1f1b`` (``ep4 etp``: expert-parallel,
        experts split over TP)."""
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"]
        parts += [f"cp{self.cp}" + ("r" if self.cp_comm == "ring" else "")] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += ["etp"] if self.expert_tp and self.tp > 1 else []
        parts += [f"v{self.virtual_stages}"] if self.virtual_stages > 1 else []
        parts += [f"mb{self.microbatch_size}"] + (["sp"] if self.sequence_parallel else [])
        parts += [{"none": "norc", "selective": "sel", "full": "full"}[self.recompute], f"z{self.zero}"]
        parts += [] if self.partition == "balanced" else [f"cut {self.partition}" if isinstance(self.partition, str)
                                                          else "cut " + "-".join(map(str, self.partition))]
        return " ".join(parts + [self.schedule] + ([] if self.runnable else ["(plan-only)"]))

    @property
    def runnable(self) -> bool:
        """Whether plait's runtime runs this layout (else it is plan-only: ``runtime_gap`` says why)."""
        return runtime_gap(self) is None


def runtime_gap(layout: Layout) -> str | None:
    """Why plait's runtime cannot run ``layout`` (its first field outside ``RUNTIME``), or None."""
    for name, allowed in RUNTIME.items():
        value = getattr(layout, name)
        if value not in allowed:
            return f"{name}: {value!r} is planned but the runtime runs {', '.join(map(str, allowed))}"
    if layout.zero == 3 and layout.schedule not in ZERO3_SCHEDULES:
        return (f"zero: 3 with schedule {layout.schedule!r} is planned but the runtime runs ZeRO-3 under "
                f"{', '.join(ZERO3_SCHEDULES)} only (no split backward)")
    return None


#: SMs a pipelined reduce-scatter's kernels hold under TP communication overlap where its configuration sets none:
#: Transformer Engine's default num_sm for the "pipeline" method (initialize_ub's get_default_config,
#: NVIDIA/TransformerEngine transformer_engine/pytorch/module/base.py at 3b2a7b00), per GEMM (proj_fprop, fc2_fprop)
TE_OVERLAP_SMS = (16, 16)
#: the most SMs a userbuffers kernel runs on: its completion counters assume at most NVTE_MAX_SMS blocks
#: (NVIDIA/TransformerEngine transformer_engine/common/comm_gemm_overlap/userbuffers/userbuffers.h at 3b2a7b00)
UB_MAX_SMS = 32
#: the gradient dtypes a costed stack may keep and reduce (``Training.grad_dtype``), and their bytes
GRAD_DTYPES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
#: the one plait's runtime keeps: float32 gradients (main_grad buffers, ZeRO shards), reduced in float32
RUNTIME_GRAD_DTYPE = "fp32"
#: which tensors a layer keeps under selective recomputation (``Training.selective_policy``, ``plan.memory``)
SELECTIVE_POLICIES = ("korthikanti", "torchtitan-op")
#: how the loss holds the logits at its peak (``Training.loss``, ``plan.memory.LOGIT_BYTES``)
LOSSES = ("fp32-logits", "torch-cross-entropy", "megatron-vocab-parallel")

#: ``Training`` fields that describe other stacks' runs: (field, plait's runtime's value, what the runtime does)
OTHER_STACKS: tuple[tuple[str, object, str], ...] = (
    ("selective_policy", SELECTIVE_POLICIES[0], "is planned with Korthikanti et al.'s selective set"),
    ("loss", LOSSES[0], "is planned with Korthikanti et al.'s 4 B a logit"),
    ("grad_dtype", RUNTIME_GRAD_DTYPE, f"keeps and reduces {RUNTIME_GRAD_DTYPE} gradients"),
    ("optimizer", RUNTIME_OPTIMIZER, f"runs {RUNTIME_OPTIMIZER}"),
    ("grad_accumulation", RUNTIME_ACCUMULATION, "accumulates its own way"),
    ("tp_comm_overlap", False, "runs SP's collectives exposed (no Megatron-Core overlap)"),
    ("sp_async_backward", False, "runs SP's backward collectives exposed (no asynchronous gather or scatter)"),
    ("overlap_param_gather", False, "gathers the updated weights after the step (no Megatron-Core overlap)"),
    ("tp_overlap_sms", TE_OVERLAP_SMS, "runs no userbuffers"),
    ("tied_grad_sum", "shard", "sums a tied embedding's gradient over its reduced shard"),
    ("zero3_impl", "plait", "runs its own block-wise ZeRO-3"),
    ("recompute_early_stop", True, "stops each block's recomputation once its saved tensors are back"),
)

#: where a stack sums a tied embedding's gradient over the pipeline stages holding a copy (``Training.tied_grad_sum``)
TIED_GRAD_SUMS = ("shard", "full")
#: whose ZeRO-3 a run's step runs (``Training.zero3_impl``)
ZERO3_IMPLS = ("plait", "deepspeed-0.3", "deepspeed-0.3-contiguous", "torchtitan-fsdp2")


@dataclass(frozen=True)
class Training:
    """A training workload: ``global_batch`` sequences per optimizer step. ``overlap_grad_reduce``: DP gradient
    reduction overlaps the last micro-batch's backward, chunk by chunk under an interleaved schedule
    (``plan.overlap.exposed_tail``; on GPUs: a calibrated host's cores are all computing then,
    ``CostModel.hidden_reduction``). ``precision``: "bf16" (mixed precision: bf16 compute, fp32 gradients and
    moments, fp32 masters kept as ``masters`` says) or "fp32" (everything fp32, ``plait train``'s default)."""

    global_batch: int
    overlap_grad_reduce: bool = True
    precision: str = "bf16"
    masters: str = "apart"  # where a bf16 run keeps its fp32 master weights: ``plan.optimizers.MASTERS``
    grad_dtype: str = RUNTIME_GRAD_DTYPE
    """The dtype the costed stack keeps its gradients in and reduces them in over data parallelism: "fp32" (plait's
    runtime, Megatron-LM with bf16, torchtitan's FSDP2), "bf16" or "fp16" (2 bytes alike: a 16-bit gradient buffer, as
    Megatron-Core's DDP with ``grad_reduce_in_fp32=False`` or DeepSpeed's fp16 ZeRO-1 keep; FSDP with a 16-bit
    ``reduce_dtype``). It sets the bytes of the gradients held below ZeRO-3 (``plan.memory.state_bytes``) and of every
    gradient collective: the DP all-reduce or reduce-scatter, ZeRO-3's per-block reduce-scatters, the TP sum of partial
    gradients (``plan.step_end``). ZeRO-3's held shards stay 4 B (the float32 master's gradient). A 16-bit value needs
    ``precision="bf16"``. plait's runtime keeps fp32: ``Layout.to_parallel_config`` refuses another."""
    recompute_head: bool = True
    """Full recomputation recomputes the head too, as plait's does; False: the layers only (Megatron-LM, torchtitan)."""
    recompute_early_stop: bool = True
    """Full recomputation stops once the block's saved tensors are saved again, as torch >= 2.1's non-reentrant
    checkpoint (plait's runtime) does: ``timing.recomputed_gemms``. False: it re-runs the block whole (reentrant)."""
    tp_comm_overlap: bool = False
    """SP's gathers and scatters cut into per-rank pieces pipelined with the GEMMs that consume or produce them, as
    Megatron-Core's ``tp_comm_overlap`` runs them with Transformer Engine's userbuffers (Wang et al. 2023;
    ``plan.tp_comm.userbuffers``). Without SP the all-reduces stay exposed. Catalogue GPUs only."""
    sp_async_backward: bool = False
    """Without userbuffers, SP's backward as Megatron-style column-parallel layers run it: the input gathered again
    beside the data-gradient GEMM, its gradient reduce-scattered beside the weight-gradient GEMM
    (``plan.tp_comm.async_backward``); plait's runtime gathers again and scatters exposed. Catalogue GPUs only."""
    overlap_param_gather: bool = False
    """ZeRO-1/2's all-gather of the updated weights issued after the step and waited for by each chunk's first
    forward of the next one, as Megatron-Core's distributed optimizer runs it with ``overlap_param_gather``
    (``plan.overlap.exposed_tail``); otherwise it follows the optimizer step, exposed."""
    optimizer: str = RUNTIME_OPTIMIZER
    """The implementation of the optimizer step and its gradient clipping, which sets the HBM bytes the step moves per
    parameter element (``plan.optimizers.OPTIMIZERS``, each counted from its code): "torch-fused-adamw" (plait's
    runtime: torch's fused AdamW, plait's float64 gradient norm), "megatron-fp16" (Megatron-LM's fp16 optimizer
    around apex's FusedAdam), "megatron-core-bf16" (Megatron-Core's distributed optimizer, a 16-bit gradient buffer),
    "apex-distributed-adam" (apex's DistributedFusedAdam), "deepspeed-bf16" and "deepspeed-zero-fp16" (DeepSpeed's
    BF16_Optimizer, its ZeRO-1/2 with fp16), "composer-decoupled-adamw" (Composer's per-tensor DecoupledAdamW,
    FSDP's clip) or "torch-foreach-adamw" (torch's foreach AdamW and clip_grad_norm_). Another stack's step also
    replaces plait's ZeRO publish (``step_end.publish_time``), DeepSpeed's ZeRO-1 its reduce-scatter
    (``step_end.ZERO1_ALL_REDUCE``). ``Layout.to_parallel_config`` refuses any but plait's."""
    tp_overlap_sms: tuple[int, int] = TE_OVERLAP_SMS
    """Under ``tp_comm_overlap``, the SMs (1 to ``UB_MAX_SMS``) the pipelined reduce-scatter after the attention's
    output projection and the one after the MLP's last GEMM hold while their GEMMs run on the rest: Transformer
    Engine's userbuffers ``num_sm`` of ``proj_fprop`` and ``fc2_fprop``, as the run's configuration sets them
    (NeMo's ``tp_comm_overlap_cfg``); Transformer Engine's default otherwise. Costed as a share of the GPU's SMs
    (``GPU.sms``): ``plan.tp_comm.overlapped_scatter``. plait's runtime runs no userbuffers:
    ``Layout.to_parallel_config`` refuses any other value."""
    grad_accumulation: str = RUNTIME_ACCUMULATION
    """The implementation that accumulates each micro-batch's weight gradients into the step's gradient buffer
    (or, under FSDP, into the rank's shard), which sets the HBM bytes every backward moves per parameter element
    (``plan.accumulation.ACCUMULATIONS``, each counted from its code): "plait" (plait's runtime: fp32 bucket
    buffers, by precision and ZeRO stage), "autograd-16bit" (autograd's in-place add into a 16-bit ``.grad``:
    Megatron-LM's DDP without contiguous buffers, DeepSpeed's fp16 ZeRO-1), "apex-distributed-adam" (its hook
    adds each bf16 gradient into an fp32 bucket), "apex-distributed-adam-fused" and "megatron-core-bf16-fused"
    (the GEMM weights accumulate inside the weight-gradient GEMM, the rest as the hook does), "deepspeed-bf16"
    (BF16_Optimizer's update_hp_grads), "fsdp1-bf16" or "fsdp2-fp32" (a reduce-scatter every backward, the
    shard accumulated). Charged in each chunk's backward (``plan.timing.chunk_costs``).
    ``Layout.to_parallel_config`` refuses any but plait's."""
    tied_grad_sum: str = "shard"
    """What of a tied embedding's gradient the stack sums over the first and last pipeline stages once a step
    (``plan.step_end.tied_sum_time``): "shard" (plait's runtime, ``plait.pipeline.ties``: the reduced elements
    after the DP reduction, 1/(dp·cp) of them under ZeRO) or "full" (the whole vocabulary shard's gradient:
    Megatron-LM's embedding-group all-reduce, DeepSpeed's pipeline engine's ReduceTiedGrads).
    ``Layout.to_parallel_config`` refuses any but plait's."""
    zero3_impl: str = "plait"
    """Whose ZeRO-3 runs the step (ignored below ZeRO-3): "plait" (plait's runtime, ``plait.data_parallel.
    param_shards``: one all-gather and one reduce-scatter per block, a block ahead of or behind the compute,
    ``plan.step_end.zero3_collectives``) or "deepspeed-0.3" (DeepSpeed v0.3.13's: one all-gather per parameter
    behind a device-wide synchronize, the gradients all-reduced in buckets ("-contiguous": reduce-scattered tensor
    by tensor), walked sub-module by sub-module in ``plan.zero3_deepspeed``; no pipeline) or "torchtitan-fsdp2"
    (torch's FSDP2 as torchtitan wraps it: timed as plait's, its memory as ``plan.memory.fsdp2_working`` and
    ``rank_memory`` count it). ``Layout.to_parallel_config`` refuses any but plait's."""
    elementwise: str = ELEMENTWISE[0]
    """How the costed stack runs a layer's element-wise kernels (norms, RoPE, activations, residual adds, casts) and
    its loss's on catalogue GPUs: "fused" (the GPU model's ``GPU.elementwise_traffic``, fitted on the published
    Megatron-style runs, whose kernels are fused: every published row) or "plait-eager" (plait's runtime, which runs
    each of them as its own eager PyTorch kernel: ``plan.eager``, counted from plait's code, their bytes at the
    GPU's memory bandwidth, and its activations counted tensor by tensor as autograd saves them,
    ``plan.host.costs.eager_activations``; ``plan.runs.train_layout`` sets it for ``plait train``'s prediction).
    A calibrated host measures plait's own kernels and counts its activations so whatever it says."""
    selective_policy: str = SELECTIVE_POLICIES[0]
    """Under ``recompute="selective"``, which tensors each layer keeps for its backward (``plan.memory``):
    "korthikanti" (Megatron-LM's and plait's: all but the attention scores, Korthikanti et al. 2022, §5) or
    "torchtitan-op" (torchtitan's per-op checkpoint policy: the block's input, every other matmul's output and the
    fused attention's, the rest recomputed; ``plan.memory.torchtitan_op_layer``)."""
    loss: str = LOSSES[0]
    """How the loss holds the logits at its peak (``plan.memory.LOGIT_BYTES``): "fp32-logits" (Korthikanti et
    al. 2022, §4.3: the float32 logits kept for the backward, 4 B each) or "torch-cross-entropy" (torch's
    ``cross_entropy`` on a float32 copy of the logits, as torchtitan's ``loss_fn`` calls it: 12 B each at the
    log-softmax's backward) or "megatron-vocab-parallel" (Megatron-Core's vocab-parallel cross-entropy: the 16-bit
    logits beside their float32 copy, 6 B each)."""
    document_mask: bool = False  # attention within packed documents (plait train --document-mask): plan.documents
    documents: DocumentLengths | None = None  # how the documents cut the rows, for its step time (None: as without)

    def __post_init__(self) -> None:
        if int(self.global_batch) < 1:
            raise FieldError("global_batch", self.global_batch, "must be >= 1 sequence")
        for name in ("overlap_grad_reduce", "tp_comm_overlap", "overlap_param_gather", "sp_async_backward",
                     "recompute_early_stop", "document_mask"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: must be True or False, got {getattr(self, name)!r}")
        for name, choices in (("precision", PRECISIONS), ("grad_dtype", tuple(GRAD_DTYPES)),
                              ("optimizer", tuple(OPTIMIZERS)), ("tied_grad_sum", TIED_GRAD_SUMS),
                              ("zero3_impl", ZERO3_IMPLS), ("grad_accumulation", tuple(ACCUMULATIONS)),
                              ("selective_policy", SELECTIVE_POLICIES), ("loss", LOSSES),
                              ("elementwise", ELEMENTWISE), ("masters", MASTERS)):
            if getattr(self, name) not in choices:
                raise FieldError(name, getattr(self, name), f"not one of {', '.join(choices)}")
        check_documents(self.document_mask, self.documents)
        sms = tuple(self.tp_overlap_sms) if isinstance(self.tp_overlap_sms, (tuple, list)) else ()
        if len(sms) != 2 or not all(type(n) is int and 1 <= n <= UB_MAX_SMS for n in sms):
            raise ConfigError(f"tp_overlap_sms: must be two integers from 1 to {UB_MAX_SMS} (the SMs of proj_fprop's "
                              f"and fc2_fprop's reduce-scatters), got {self.tp_overlap_sms!r}")
        object.__setattr__(self, "tp_overlap_sms", sms)
        if self.precision == "fp32" and self.grad_dtype != "fp32":
            raise ConfigError(f"grad_dtype: {self.grad_dtype!r} needs precision='bf16' (fp32 training keeps fp32 "
                              "gradients)")


def microbatches(layout: Layout, training: Training) -> int:
    """M, the micro-batches each pipeline replica runs per step."""
    return training.global_batch // (layout.dp * layout.microbatch_size)


def check(model: Model, cluster: Cluster, layout: Layout, training: Training) -> tuple[str, str] | None:
    """The first rule the layout breaks as (reason key, message naming the parameter), else None."""
    l, tp = layout, layout.tp
    if l.world != cluster.n_gpus:
        return "world", (f"layout: tp·cp·dp·pp = {l.world} must equal n_gpus = {cluster.n_gpus}")
    if tp > cluster.gpus_per_node:
        return "tp>node", f"tp: {tp} exceeds gpus_per_node = {cluster.gpus_per_node} (TP stays in a node)"
    if model.n_heads % tp:
        return "heads%tp", f"tp: {tp} must divide n_heads = {model.n_heads}"
    if model.kv_heads % tp and tp % model.kv_heads:
        return "kv%tp", f"tp: {tp} must divide n_kv_heads = {model.kv_heads} (or be a multiple of it)"
    if model.ffn % tp:
        return "ffn%tp", f"tp: {tp} must divide ffn_hidden = {model.ffn}"
    if l.sequence_parallel and model.seq_len % tp:
        return "seq%tp", f"sequence_parallel: tp = {tp} must divide seq_len = {model.seq_len}"
    if model.n_layers < l.pp * l.virtual_stages:
        return "layers<stages", f"pp·virtual_stages: {l.pp * l.virtual_stages} exceeds n_layers = {model.n_layers}"
    if not isinstance(l.partition, str):
        try:  # the runtime's own check of explicit counts
            partition_layers(model.n_layers, l.pp * l.virtual_stages, l.partition)
        except ConfigError as e:
            return "partition", str(e)
    if l.cp > 1 and model.seq_len % (unit := math.lcm(2 * l.cp, l.cp * tp if l.sequence_parallel else 1)):
        return "seq%cp", f"cp: {unit} (2·cp chunks, each rank's over tp with SP) must divide seq_len = {model.seq_len}"
    if training.global_batch % (l.dp * l.microbatch_size):
        return "batch%dp", (f"global_batch: {training.global_batch} must be a multiple of "
                            f"dp·microbatch_size = {l.dp * l.microbatch_size}")
    m = microbatches(layout, training)
    if l.schedule == "dualpipev" and m < 2 * l.pp:
        return "microbatches%pp", f"microbatches: dualpipev needs >= 2·pp = {2 * l.pp}, got {m}"
    if bad := experts.check(model, l):
        return bad
    if l.sequence_parallel and tp == 1:
        return "sp", "sequence_parallel: needs tp > 1"
    if training.selective_policy == "torchtitan-op" and l.recompute == "selective" and tp * l.cp > 1:
        return "policy", (f"selective_policy: 'torchtitan-op' is counted for tp = cp = 1 only, got tp = {tp}, "
                          f"cp = {l.cp}")
    if training.zero3_impl != "plait" and l.zero == 3 and l.pp > 1:
        return "zero3_impl", f"zero3_impl: {training.zero3_impl!r} is costed without a pipeline, got pp = {l.pp}"
    if l.pp == 1 and (l.virtual_stages > 1 or l.schedule != "1f1b"):
        return "schedule", "schedule: with pp = 1 use schedule='1f1b', virtual_stages=1 (no pipeline)"
    return None


def validate(model: Model, cluster: Cluster, layout: Layout, training: Training) -> None:
    """Raise ConfigError for the first broken rule (memory is checked by ``estimate``)."""
    bad = check(model, cluster, layout, training)
    if bad:
        raise ConfigError(bad[1])
