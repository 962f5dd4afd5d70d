"""The optimizer step's HBM traffic by implementation (``Training.optimizer``): the bytes each training stack's
optimizer step and gradient clipping read and write per parameter element, counted from its code.

Each op counts what it reads and writes once: an in-place ``x.mul_(c)`` on fp32 reads 4 B and writes 4; an
out-of-place op writes a new tensor; ``addcmul_(g, g)`` reads its gradient once. A fused kernel counts its inputs
and outputs only. A clip's scale that runs only when the norm exceeds ``max_norm`` (``if clip_coeff < 1``) is not
charged: the sources print no gradient norms. One that multiplies by the clamped coefficient on every step is.
Fixed per-tensor costs (launches, the host syncs of a per-tensor loop) are not counted: these stacks update few,
large tensors (flat buffers or FSDP's flat parameters).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerTraffic:
    """HBM bytes of one optimizer step (the gradient norm and clip, the update, the copies around it)."""

    owned: float
    """Per element a rank updates: under ZeRO its shard (1/(dp·cp) of its parameters), else all of them."""
    replica: float = 0.0
    """Per element of every parameter the rank holds, whatever it updates (full-size gradient buffers it norms or
    zeroes, the copy of the gathered weights into the model's parameters)."""


#: bytes per element, by implementation; each entry's count is in the comment above it
OPTIMIZERS: dict[str, OptimizerTraffic] = {
    # plait's runtime on a GPU (plait.optim.build_optimizer, clipped as plait train's default clip 1.0 does): the
    # gradient norm is torch's fused multi-tensor norm, accumulating in float64 as it reads each fp32 gradient
    # once (plait/optim/optimizer.py square_sum: read 4); the clip's scale only when the norm exceeds max_norm;
    # torch.optim.AdamW(fused=True) on the fp32 parameters (ZeRO: the fp32 masters) reads p, g, m, v and writes
    # p, m, v in one pass (28). Under ZeRO-1/2 the bf16 weights are published by plait's own copies
    # (``plan.step_end.publish_time``).
    "torch-fused-adamw": OptimizerTraffic(owned=4 + 28),
    # Megatron-LM's Float16OptimizerWithFloat16Params with fp16 (NVIDIA/Megatron-LM megatron/optimizer/optimizer.py
    # at de7dc40f, step): main_param.grad = model grad .float() (read 2, write 4); torch's
    # _amp_foreach_non_finite_check_and_unscale_ on the fp32 main gradients (read 4, write 4); clip_grad_norm_fp32's
    # multi_tensor_l2norm (read 4; its multi_tensor_scale only if clip_coeff < 1); apex FusedAdam
    # (megatron/optimizer/__init__.py), amp_C.multi_tensor_adam over [g, p, m, v] fp32 (NVIDIA/apex
    # csrc/multi_tensor_adam.cu at a651e2c2: reads 16, writes p, m, v 12); _copy_main_params_to_model_params,
    # multi_tensor_scale fp32 -> fp16 (read 4, write 2). 6 + 8 + 4 + 28 + 6.
    "megatron-fp16": OptimizerTraffic(owned=6 + 8 + 4 + 28 + 6),
    # Megatron-Core's DistributedOptimizer with a 16-bit gradient buffer and bf16 (NVIDIA/Megatron-LM
    # megatron/core/optimizer/distrib_optimizer.py at ee6737da): _copy_model_grads_to_main_grads,
    # shard_model_grad.float() (read 2, write 4); get_grad_norm_fp32's multi_tensor_l2norm on the fp32 main
    # gradients (read 4; clip_grad_by_total_norm_fp32 scales only if clip_coeff < 1); Transformer Engine's
    # FusedAdam (megatron/core/optimizer/__init__.py) over [g, p, m, v] fp32 (NVIDIA/TransformerEngine
    # transformer_engine/pytorch/optimizers/fused_adam.py at 69365f88: 28); _copy_main_params_to_model_params into
    # the bf16 parameter buffer (read 4, write 2); the all-gather then writes the parameters. 6 + 4 + 28 + 6.
    "megatron-core-bf16": OptimizerTraffic(owned=6 + 4 + 28 + 6),
    # apex's DistributedFusedAdam (NVIDIA/apex apex/contrib/optimizers/distributed_fused_adam.py at 6f7d8ac3) with
    # fp32 state and gradients, its default store_params (an fp32 copy of the shard) and bf16 parameter sync:
    # _local_grad_norm's multi_tensor_l2norm on the fp32 gradient shard (read 4); clip_grad_norm folds the clip into
    # _grad_scale, which the step kernel applies; _local_step's multi_tensor_fused_adam over [p, m, v, g] fp32 and
    # the bf16 output shard (reads 16, writes 12 + 2); after each bucket's all-gather, _multi_tensor_copy of the
    # gathered bf16 bucket into every parameter (read 2, write 2 per parameter element).
    "apex-distributed-adam": OptimizerTraffic(owned=4 + 30, replica=4),
    # DeepSpeed's BF16_Optimizer (microsoft/DeepSpeed deepspeed/runtime/bf16_optimizer.py at 56c52238, step): the
    # norm over the rank's full-size fp32 gradient buffers (get_global_norm_of_tensors, read 4 per parameter
    # element; clip_tensors_by_global_norm scales only if clip_coef < 1); the wrapped apex FusedAdam over the fp32
    # partition (28); update_lp_params copies the fp32 partition into the bf16 one (read 4, write 2);
    # clear_hp_grads zeroes the fp32 gradient buffers (write 4 per parameter element). Megatron-DeepSpeed hands
    # DeepSpeed apex's FusedAdam as it is (bigscience-workshop/Megatron-DeepSpeed megatron/optimizer/__init__.py at
    # 497aa1bf: "if args.deepspeed: return optimizer"), multi_tensor_adam over the fp32 partition.
    "deepspeed-bf16": OptimizerTraffic(owned=28 + 6, replica=4 + 4),
    # DeepSpeed's ZeRO stage 1/2 with fp16 (microsoft/DeepSpeed deepspeed/runtime/zero/stage_1_and_2.py at v0.5.10,
    # step), per element of the rank's partition: the overflow check _has_inf_or_nan, x.float().sum() on the fp16
    # gradients (read 2, write 4, read 4); get_grad_norm_direct, g.double().norm(2) (read 2, write 8, read 8);
    # the flat partition, flatten (read 2, write 2) then .to(fp32) (read 2, write 4); unscale_and_clip_grads'
    # mul_ by 1/combined_scale on every step (the loss scale; read 4, write 4); the wrapped apex FusedAdam (28, as
    # above); the fp32 partition copied into the fp16 one (read 4, write 2). 10 + 18 + 10 + 8 + 28 + 6.
    "deepspeed-zero-fp16": OptimizerTraffic(owned=10 + 18 + 10 + 8 + 28 + 6),
    # Composer's DecoupledAdamW (mosaicml/composer composer/optim/decoupled_weight_decay.py at v0.16.3, adamw): a
    # Python loop over the parameters, separate element-wise ops on fp32: exp_avg.mul_ (8) .add_(grad) (12);
    # exp_avg_sq.mul_ (8) .addcmul_(grad, grad) (12); exp_avg_sq.sqrt() (read 4, write 4) / sqrt(bias_correction2)
    # (8) .add_(eps) (8); param.addcdiv_(exp_avg, denom) (read 12, write 4): 80, and param.mul_ (8) when
    # weight_decay is not 0 (llm-foundry's MPT yamls set 0: not counted). Composer's gradient clipping under FSDP
    # calls FullyShardedDataParallel.clip_grad_norm_ (composer/algorithms/gradient_clipping/gradient_clipping.py at
    # v0.16.3): each sharded gradient's torch.linalg.vector_norm (read 4), then grad.mul_ by the clamped
    # coefficient on every step (read 4, write 4; torch/distributed/fsdp/fully_sharded_data_parallel.py as read in
    # torch 2.13, "avoids the host-device sync that would result from `if clip_coef < 1`"; the runs' torch 2.0.1
    # and 2.1 nightly images were not read). 80 + 12.
    "composer-decoupled-adamw": OptimizerTraffic(owned=80 + 12),
    # torch.optim.AdamW(foreach=True) with weight decay (pytorch/pytorch torch/optim/adamw.py _multi_tensor_adamw at
    # 002d2f0b): _foreach_mul_(params) (8); _foreach_lerp_(exp_avgs, grads) (12); _foreach_mul_(exp_avg_sqs) (8);
    # _foreach_addcmul_(exp_avg_sqs, grads, grads) (12); _foreach_sqrt (8), _foreach_div_ (8), _foreach_add_(eps)
    # (8); _foreach_addcdiv_(params, exp_avgs, denom) (16): 80. torch.nn.utils.clip_grad_norm_(foreach=True)
    # (torch/nn/utils/clip_grad.py at 01a57d87, later than the April 2024 nightly torchtitan ran): _foreach_norm
    # (read 4), then _foreach_mul_ by the clamped coefficient on every step (8). 80 + 12.
    "torch-foreach-adamw": OptimizerTraffic(owned=80 + 12),
}
#: the implementation plait's runtime runs (``plait.optim.build_optimizer``)
RUNTIME_OPTIMIZER = "torch-fused-adamw"

#: Where a bf16 run keeps its float32 master weights (``Training.masters``; fp32 runs and ZeRO-3, whose float32
#: shards are the masters, alike either way), which sets the weights' and the optimizer state's bytes
#: (``plan.memory.state_bytes``): "apart", mixed-precision Adam as Megatron-LM runs it (bf16 weights beside
#: float32 masters and moments at every ZeRO stage: 2 + 12 B a parameter, the 12 sharded under ZeRO-1/2), or
#: "plait", plait's runtime (``plait.optim``): without ZeRO the float32 parameters are their own masters and each
#: step computes with a bf16 copy (4 + 8 B); under ZeRO-1/2 the parameters are stored in bf16 beside the float32
#: masters of the owned shard (2 + 12/d B). ``plan.runs.train_layout`` plans ``plait train`` with "plait".
MASTERS = ("apart", "plait")
RUNTIME_MASTERS = "plait"


def masters_gap(masters: str, precision: str, zero: int) -> str | None:
    """Why plait's runtime does not keep the float32 masters a plan of ``precision`` and ZeRO stage ``zero``
    assumes (``Training.masters``), or None where both ways keep the same bytes: fp32, and ZeRO-1, 2 and 3."""
    if masters == RUNTIME_MASTERS or precision != "bf16" or zero > 0:
        return None
    return (f"masters: {masters!r} is planned (bf16 weights beside float32 masters and moments: 2 + 12 B a parameter) "
            "but plait's runtime keeps a bf16 run's float32 parameters as their own masters without ZeRO (4 + 8 B): "
            f"plan with masters={RUNTIME_MASTERS!r}")
