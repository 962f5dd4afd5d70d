"""plait train's router flags (--capacity-factor, --aux-loss-coef): checked before launch, applied to the model config.

A preset's experts (--experts E) take both; a Hugging Face folder's experts (Mixtral, Qwen3-MoE) route dropless as
transformers does, so only their load-balancing weight may be set; a dense model has no router to set.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from plait.errors import ConfigError, is_number

if TYPE_CHECKING:
    from plait.models import LlamaConfig
    from plait.train.config import TrainConfig


def check_routing_flags(cfg: TrainConfig, mcfg: LlamaConfig, preset: bool) -> None:
    """ConfigError naming the flag when a router setting is out of range or has no experts to apply to."""
    c, coef = cfg.capacity_factor, cfg.aux_loss_coef
    if c is not None and not (is_number(c) and c > 0):
        raise ConfigError(f"--capacity-factor {c}: must be a finite number > 0 (leave it out: dropless)")
    if coef is not None and not (is_number(coef) and coef >= 0):
        raise ConfigError(f"--aux-loss-coef {coef}: must be a finite number >= 0 (0: no load-balancing loss)")
    given = [f"--{n} {v:g}" for n, v in (("capacity-factor", c), ("aux-loss-coef", coef)) if v is not None]
    if given and mcfg.n_experts < 2:
        raise ConfigError(f"{', '.join(given)}: --model {cfg.model} has no experts to route; pass --experts E "
                          "(E >= 2) with a preset, or a Mixtral or Qwen3-MoE folder")
    if c is not None and not preset:
        raise ConfigError(f"--capacity-factor {c:g}: --model {cfg.model}'s experts route dropless, as transformers "
                          "runs them; capacity applies to a preset's --experts")
    if c is not None and cfg.parallel.cp > 1:
        raise ConfigError(f"--capacity-factor {c:g} with --cp {cfg.parallel.cp}: expert capacity ranks a whole "
                          "sequence's tokens in position order, which context parallelism splits over ranks; "
                          "use --cp 1 or leave --capacity-factor out (dropless)")


def with_routing_flags(cfg: TrainConfig, mcfg: LlamaConfig) -> LlamaConfig:
    """``mcfg`` with the router flags given (an MoE model's; a dense one is returned as it is)."""
    if mcfg.n_experts < 2:
        return mcfg
    coef = mcfg.aux_loss_coef if cfg.aux_loss_coef is None else cfg.aux_loss_coef
    return replace(mcfg, capacity_factor=cfg.capacity_factor, aux_loss_coef=coef)
