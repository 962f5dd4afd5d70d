"""Optimizer side of 3D parallelism: global-norm clipping, LR schedule, bf16 mixed precision, ZeRO-1."""

from plait.optim.optimizer import ParallelOptimizer, build_optimizer
from plait.optim.precision import PRECISIONS, StepCast, check_precision
from plait.optim.schedule import decays, lr_at, param_groups

__all__ = ["PRECISIONS", "ParallelOptimizer", "StepCast", "build_optimizer", "check_precision", "decays",
           "lr_at", "param_groups"]
