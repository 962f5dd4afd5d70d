"""Selective activation recomputation, applied from outside the model: only the attention core is recomputed.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.2: most of a
layer's activations are cheap to keep and expensive to recompute (they feed matrix multiplications), but
the attention core — QKᵀ, the softmax, its dropout and the weighted sum of the values — stores
O(a·s²) per sequence for O(s²·h) FLOPs of recomputation. So keep the core's inputs (q, k, v) and recompute
the core during the backward. ``recompute="full"`` (pipeline.partition.PipelineChunk) instead keeps only each
block's input and recomputes the whole block.

The model is not edited: each attention module's ``core(q, k, v, mask, causal)`` (what the family adapter's
``attention_modules`` returns) is shadowed on that instance by a wrapper that runs the module's own core
under a non-reentrant ``torch.utils.checkpoint``. The checkpoint saves q, k, v (and the mask) for the
backward and nothing that the core computes; the first backward through the core recomputes it. Linear
layers stay outside the region, so a split backward (plait.weight_grad: I now, W later) defers their weight
gradients as usual. What plait keeps per layer, with and without it: docs/runtime.md, "Activation memory".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.errors import ConfigError


class RecomputedCore:
    """Calls an attention module's own core under a non-reentrant checkpoint (plain call without autograd)."""

    def __init__(self, core: Callable[..., torch.Tensor]):
        self.core = core  # the module's bound method

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 causal: bool = True) -> torch.Tensor:
        if not torch.is_grad_enabled():  # decoding or evaluation: nothing is saved anyway
            return self.core(q, k, v, mask, causal)
        # no dropout in the core: no random state to stash and restore for the recomputation
        return checkpoint(self.core, q, k, v, mask, causal, use_reentrant=False,
                          preserve_rng_state=False)  # [B, h, S, hd]


def recompute_attention(modules: dict[str, nn.Module], model_name: str = "model") -> int:
    """Recompute the core of every attention module in ``modules`` (name -> module) during backward; returns
    how many. ConfigError if there are none (the model's family names no attention modules)."""
    if not modules:
        raise ConfigError(f"recompute='selective' recomputes the attention core, but {model_name} has no attention "
                          "modules its family adapter knows of; use recompute='full' or 'none'")
    for name, module in modules.items():
        core = getattr(module, "core", None)
        if not callable(core):
            raise ConfigError(f"recompute='selective': attention module {name} has no core(q, k, v, mask, causal) to "
                              "recompute; use recompute='full' or 'none'")
        if not isinstance(core, RecomputedCore):
            setattr(module, "core", RecomputedCore(core))  # noqa: B010  (nn.Module.__setattr__ is typed for tensors and modules)
    return len(modules)
