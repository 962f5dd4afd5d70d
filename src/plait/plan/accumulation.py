"""The weight gradients' accumulation over a step's micro-batches by implementation (``Training.grad_accumulation``):
the HBM bytes each training stack moves per parameter element in every backward to get the weight gradient autograd
computed into the step's gradient buffer (or, under FSDP, into the rank's gradient shard), counted from its code.

Each op counts what it reads and writes once, as ``plan.optimizers`` counts them: an in-place ``buf.add_(g)`` of a
bf16 ``g`` into an fp32 buffer reads 2 + 4 and writes 4; a cast ``g.to(fp32)`` reads 2 and writes 4. Autograd hands
the tensor a GEMM computed to a parameter whose ``.grad`` is None without a copy (``AccumulateGrad``), and adds it
in place (read both, write one) into a ``.grad`` that exists. The weight-gradient GEMM's own output write is the
GEMM's, charged with its FLOPs. NCCL's own traffic is not counted (the collectives are costed on the network).

Fused accumulation (``fused``: Megatron's ``gradient_accumulation_fusion``, apex's fused_weight_gradient_mlp_cuda
``wgrad_gemm_accum_fp32`` / Transformer Engine's ``fuse_wgrad_accumulation``): the weight-gradient GEMM runs with
beta = 1 on the fp32 (or 16-bit) main gradient, so its epilogue reads and writes the accumulator instead of writing
a 16-bit output. That GEMM over k = the micro-batch's tokens (>= 2048 in every costed run) does 2k FLOPs per output
element against at most 8 bytes of epilogue traffic, >= 512 FLOPs a byte where the A100 needs 153 and the H100
295 to be compute-bound (peak over HBM bandwidth): its time is taken as its FLOPs at the fitted matmul efficiency
(``plan.gpu``), the epilogue inside it. Nothing more is charged for the GEMM weights; the parameters no GEMM
produces (norms, the embedding table) go through the stack's unfused path; biases, which take that path too, are
left out with their weights (under 0.1% of a layer's parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import ConfigError


@dataclass(frozen=True)
class AccumulationTraffic:
    """HBM bytes one backward moves per parameter element to accumulate its weight gradient."""

    every: float = 0.0
    """Per element the rank holds (a pipeline rank's layers; under ZeRO-3 / FSDP the gathered ones), every
    micro-batch."""
    later: float = 0.0
    """Per element the rank holds, on every micro-batch but the step's first (an in-place add into a gradient the
    first one left)."""
    shard_every: float = 0.0
    """Per element of the rank's gradient shard (1/(dp·cp) of what it holds), every micro-batch."""
    shard_later: float = 0.0
    """Per element of the rank's gradient shard, on every micro-batch but the step's first."""
    fused: bool = False
    """The GEMM weights accumulate inside their weight-gradient GEMM (nothing charged for them)."""
    after_backward: bool = False
    """Under a split backward (zero-bubble schedules) the gradients reach the buffer through one autograd node
    that runs after a model chunk's whole backward, so no bucket's reduction can start during that chunk's last
    backward (``plan.overlap.dp_exposed``); the other schedules hand each reduced bucket over when it is complete."""


#: plait's runtime (plait.data_parallel.reducer, zero3_reducer, plait.optim.precision) by (precision, ZeRO stage)
RUNTIME_TRAFFIC: dict[tuple[str, int], AccumulationTraffic] = {
    # bf16 without ZeRO: a bucket's bf16 gradients are added into its fp32 buffer (GradReducer.take: one foreach
    # add, the cast inside it: read 2 + 4, write 4). A bucket reduced over other ranks gets them from leaf copies
    # through one multi-gradient hook as soon as they are complete; under a split backward, and without other
    # ranks, from one autograd node (plait.optim.precision._CastGroup) made before the forward, which autograd
    # (newest ready node first) runs after the chunk's whole backward.
    ("bf16", 0): AccumulationTraffic(every=10, after_backward=True),
    # bf16 under ZeRO-1/2: the parameters are stored in bf16 (StepCast.set_storage), autograd hands over the bf16
    # gradient, and the post-accumulate hook adds it into the fp32 bucket buffer and drops it
    # (GradReducer._absorb: view.add_(g): read 2 + 4, write 4).
    ("bf16", 1): AccumulationTraffic(every=10),
    ("bf16", 2): AccumulationTraffic(every=10),
    # ZeRO-3 (Zero3Reducer._launch): each block's bf16 gradients copied into a float32 [padded] input (read 2,
    # write 4), reduce-scattered, and the [shard] result added into the rank's sum from the second backward on
    # (_settle: reduced.add_(out): read 4 + 4, write 4).
    ("bf16", 3): AccumulationTraffic(every=6, shard_later=12),
    # fp32: the gradients are fp32 from the GEMMs; autograd adds them in place into the bucket view (read 4 + 4,
    # write 4); ZeRO-3 copies them (read 4, write 4) and adds the shard as above.
    ("fp32", 0): AccumulationTraffic(every=12),
    ("fp32", 1): AccumulationTraffic(every=12),
    ("fp32", 2): AccumulationTraffic(every=12),
    ("fp32", 3): AccumulationTraffic(every=8, shard_later=12),
}
#: the implementation plait's runtime runs (its bytes: ``RUNTIME_TRAFFIC``)
RUNTIME_ACCUMULATION = "plait"

#: bytes per element, by implementation; each entry's count is in the comment above it
ACCUMULATIONS: dict[str, AccumulationTraffic | None] = {
    RUNTIME_ACCUMULATION: None,  # by precision and ZeRO stage: RUNTIME_TRAFFIC
    # Autograd accumulating into a 16-bit ``.grad`` the optimizer set to None before the step: the first
    # micro-batch's gradient is handed over, each later one added in place (read 2 + 2, write 2). Megatron-LM's
    # local DDP without contiguous buffers (NVIDIA/Megatron-LM megatron/model/distributed.py at de7dc40f: the
    # main_grad hook exists only with use_contiguous_buffers; --use-contiguous-buffers-in-ddp is off by default
    # and fp16 leaves --accumulate-allreduce-grads-in-fp32 off; Float16OptimizerWithFloat16Params.zero_grad
    # sets grads to None), torch DDP under no_sync there (megatron/schedules.py), and DeepSpeed's fp16 ZeRO-1
    # without overlap_comm (microsoft/DeepSpeed deepspeed/runtime/zero/stage_1_and_2.py at v0.5.10: no gradient
    # hooks unless partition_gradients or overlap_comm; the reduction runs at the boundary, reduce_gradients).
    # Copies into and out of a reduction's buckets on the last micro-batch are once a step: not counted here.
    "autograd-16bit": AccumulationTraffic(later=6),
    # apex's DistributedFusedAdam (NVIDIA/apex apex/contrib/optimizers/distributed_fused_adam.py at 6f7d8ac3)
    # with NeMo's contiguous fp32 gradient buffer (NVIDIA/NeMo v1.11.0 megatron_gpt_model.py:
    # contiguous_grad_buffer; no_sync(greedy_grad_copy=True)): autograd hands over the bf16 gradient, the
    # post-accumulate hook's _grad_copy adds it into the fp32 bucket (grad_out.add_(grad_in): read 2 + 4,
    # write 4) and sets param.grad to None.
    "apex-distributed-adam": AccumulationTraffic(every=10),
    # The same with gradient_accumulation_fusion (NeMo v1.11.0 keeps it only with a pipeline and megatron_amp_O2:
    # megatron_base_model.py _validate_config): the GEMM weights accumulate into param.main_grad, NeMo's
    # MegatronDistributedFusedAdam's grad_buffer_view (nemo/core/optim/optimizers.py at v1.11.0); the rest as above.
    "apex-distributed-adam-fused": AccumulationTraffic(every=10, fused=True),
    # Megatron-Core's DDP with a 16-bit gradient buffer and gradient_accumulation_fusion (NVIDIA/Megatron-LM
    # megatron/core/distributed/distributed_data_parallel.py at ee6737da, _make_backward_post_hook): the GEMM
    # weights accumulate in their GEMM (megatron/core/extensions/transformer_engine.py passes
    # fuse_wgrad_accumulation; NVIDIA/TransformerEngine transformer_engine/pytorch/module/linear.py at 3b2a7b00
    # marks grad_added_to_main_grad and the hook adds nothing); the rest param.main_grad.add_(param.grad) in bf16
    # (read 2 + 2, write 2), param.grad set to None.
    "megatron-core-bf16-fused": AccumulationTraffic(every=6, fused=True),
    # DeepSpeed's BF16_Optimizer under its pipeline engine (microsoft/DeepSpeed deepspeed/runtime/pipe/engine.py
    # at 56c52238, _exec_backward_pass: clear_lp_grads before each backward, update_hp_grads after it;
    # bf16_optimizer.py: hp_grad.add_(lp.grad.to(fp32))): the cast (read 2, write 4) and the in-place add into
    # the fp32 buffer (read 4 + 4, write 4), every micro-batch.
    "deepspeed-bf16": AccumulationTraffic(every=6 + 12),
    # FSDP1's FULL_SHARD with bf16 reduction (torch/distributed/fsdp/_runtime_utils.py as read in torch 2.13, the
    # runs' torch 2.0.1 and 2.1 nightly not read), a reduce-scatter in every backward (Composer runs FSDP without
    # no_sync: composer/trainer/trainer.py at v0.16.3, the sync context only for DistributedDataParallel). Per
    # held element: the flat parameter's gradient assembled from its views' gradients (the backward of
    # _flat_param.py's torch.split: read 2, write 2), _div_if_needed by the pre-divide factor (read 2, write 2).
    # Per shard element: the post-divide (read 2, write 2), _cast_grad_to_param_dtype to the fp32 shard (read 2,
    # write 4), and from the second backward on _saved_grad_shard += (read 4 + 4, write 4).
    "fsdp1-bf16": AccumulationTraffic(every=4 + 4, shard_every=4 + 6, shard_later=12),
    # FSDP2 with fp32 reduction (pytorch/pytorch torch/distributed/_composable/fsdp/_fsdp_collectives.py as read at
    # 01d66d21, foreach_reduce_scatter; the nightly torchtitan ran is not pinned): per held element the bf16
    # gradients concatenated into the fp32 reduce-scatter input (torch.cat(..., out=): read 2, write 4) and
    # pre-divided in place (read 4, write 4); per shard element the post-divide (read 4, write 4), and from the
    # second backward on sharded_param.grad += (read 4 + 4, write 4).
    "fsdp2-fp32": AccumulationTraffic(every=6 + 8, shard_every=8, shard_later=12),
}


def traffic(name: str, precision: str, zero: int) -> AccumulationTraffic:
    """The bytes of implementation ``name`` (plait's by ``precision`` and ``zero``)."""
    if name not in ACCUMULATIONS:
        raise ConfigError(f"grad_accumulation: {name!r} is not one of {', '.join(ACCUMULATIONS)}")
    return ACCUMULATIONS[name] or RUNTIME_TRAFFIC[(precision, zero)]

