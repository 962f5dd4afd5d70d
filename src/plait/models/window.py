"""Sliding-window attention, a fact of the model: which layers take the window, and the window's mask.

A window W lets the query at position p see the keys j with p - W < j <= p (itself and the W - 1 before it).
Mistral and Mixtral put it on every layer; Qwen2 and Qwen3 say per layer (``layer_types``, one of ``LAYER_TYPES``
per layer, as transformers' configs do): ``"sliding_attention"`` layers take the window, ``"full_attention"`` layers
see every earlier key.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.errors import ConfigError
from plait.hf_config import FULL, SLIDING

LAYER_TYPES = (FULL, SLIDING)


def check_layer_types(layer_types: Sequence[str] | None, n_layers: int, window: int | None) -> tuple[str, ...] | None:
    """``layer_types`` as a tuple (None stays None: every layer takes ``window``); ConfigError naming the field when
    it is not one of ``LAYER_TYPES`` per layer, or names sliding layers without a window."""
    if layer_types is None:
        return None
    if isinstance(layer_types, str) or not isinstance(layer_types, Sequence):
        raise ConfigError(f"LlamaConfig.layer_types={layer_types!r} must be a list of {n_layers} of "
                          f"{', '.join(map(repr, LAYER_TYPES))} (or None: every layer takes sliding_window)")
    types = tuple(layer_types)
    bad = next((t for t in types if t not in LAYER_TYPES), None)
    if len(types) != n_layers or bad is not None:
        kinds = ", ".join(map(repr, LAYER_TYPES))
        raise ConfigError(f"LlamaConfig.layer_types: {len(types)} entries{f', among them {bad!r}' if bad else ''}; "
                          f"it needs one per layer (n_layers={n_layers}), each one of {kinds}")
    if window is None and SLIDING in types:
        raise ConfigError(f"LlamaConfig.layer_types names {SLIDING!r} layers but sliding_window=None: give the "
                          f"window, or make every layer {FULL!r}")
    return types


def layer_window(window: int | None, layer_types: Sequence[str] | None, index: int) -> int | None:
    """The window of layer ``index`` (None: it sees every earlier key)."""
    if window is None or layer_types is None:
        return window
    return window if layer_types[index] == SLIDING else None


def every_layer_window(window: int | None, layer_types: Sequence[str] | None) -> int | None:
    """The window every layer takes (None: some layer sees every earlier key)."""
    return None if layer_types is not None and FULL in layer_types else window


def window_mask(pos: torch.Tensor, length: int, window: int) -> torch.Tensor:
    """Causal sliding-window mask: query at position ``pos`` sees key j iff pos - window < j <= pos.

    ``pos`` [S] -> [S, L]; per-row ``pos`` [B, S] -> [B, 1, S, L] (keys are positions 0..L-1).
    """
    keys = torch.arange(length, device=pos.device)
    mask = (keys <= pos[..., None]) & (keys > pos[..., None] - window)
    return mask if pos.dim() == 1 else mask[:, None]
