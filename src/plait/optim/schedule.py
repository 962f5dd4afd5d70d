"""Learning-rate schedule (linear warm-up, cosine decay) and weight-decay parameter groups."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, lr: float, warmup: int = 0, total_steps: int | None = None, min_ratio: float = 0.1) -> float:
    """Learning rate of optimizer update ``step`` (0-based).

    Linear warm-up over ``warmup`` updates (Goyal et al. 2017, §2.2): ``lr·(step+1)/warmup``; then cosine
    decay to ``min_ratio·lr`` at ``total_steps`` (Loshchilov & Hutter 2017, SGDR, eq. 5 without restarts):
    ``lr·(min_ratio + (1-min_ratio)·(1+cos(π·t))/2)``, ``t = (step-warmup)/(total_steps-warmup)`` clamped
    to [0, 1]. ``total_steps=None`` keeps ``lr`` constant after the warm-up.
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    if total_steps is None or total_steps <= warmup:
        return lr
    t = min(1.0, (step - warmup) / (total_steps - warmup))
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t)))


def decays(name: str, param: torch.Tensor) -> bool:
    """Weight decay applies to matrices (linear weights, embeddings), not to norms or biases (1-D)."""
    return param.dim() >= 2 and not name.endswith(".bias")


def param_groups(named_params, weight_decay: float) -> list[dict]:
    """Two torch optimizer groups: decayed ``weight_decay``, not decayed 0.0 (empty groups dropped).

    ``named_params`` yields (plain-model name, tensor); works for a plain model's ``named_parameters()``
    too, so a single-device reference uses exactly the same grouping.
    """
    decay: list[torch.Tensor] = []
    plain: list[torch.Tensor] = []
    for name, p in named_params:
        if p.requires_grad:
            (decay if decays(name, p) else plain).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
