"""The model seam: what the parallel runtime needs from a model, one adapter per family, and their registry.

A family adapter answers, for the models of one class, without the runtime ever naming that class:
  blocks             the model as named blocks in execution order (pipeline chunks are cut between them),
                     which of them are the repeated layers, and each layer's relative cost (balanced cuts)
  tp_plan, check_tp  the module-path tensor-parallel plan (plait.tensor_parallel.plan) and which tp the
                     shapes allow; kv_heads for grouped-query K/V projections
  loss               the default training loss: "next_token" (cross-entropy over vocabulary logits, computed
                     on vocabulary shards) or None (the caller passes ``loss_fn``)
  kv_layer, kv_cache which blocks keep a KV cache when decoding, and a fresh cache for one of them;
                     hidden_size: what flows between stages
  attention_modules  the attention module of every layer (whose core may be recomputed alone, and whose rope
                     and core context parallelism shadows); attention_windows: how far back each one's
                     queries see
  tie_weights        re-tie shared parameters after sharding replaced modules
  init_tensor        the seeded initial value of one full state tensor (plait.models.init), so any layout
                     can initialise its shards one tensor at a time
Hugging Face families (``plait.models.decoder.DecoderFamily`` subclasses) also translate ``config.json`` and
tensor names (``plait.models.hf``; a config.json's fields, which the planner reads too: ``plait.hf_config``).
Each family is listed in the explicit registry (``plait.models.registry``): adding one is a file (a config and
model class, usually Llama's with some features on, and its ``FAMILY``), one line there and, where its folders
add fields, one in ``plait.hf_config.FAMILY_FIELDS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.errors import ConfigError


@dataclass
class Blocks:
    """A model as named blocks in execution order; ``named[first_layer : first_layer + n_layers]`` are layers.

    Blocks before the layers join the first pipeline chunk, blocks after them the last one.
    """

    named: list[tuple[str, nn.Module]]
    first_layer: int
    n_layers: int

    @property
    def layers(self) -> list[tuple[str, nn.Module]]:
        return self.named[self.first_layer:self.first_layer + self.n_layers]


@dataclass
class LayerCosts:
    """Relative forward cost of each layer, and what the first and last chunk pay on top (embedding, head)."""

    layers: list[float]
    first: float = 0.0
    last: float = 0.0


class Family:
    """The adapter of one kind of model; subclasses fill in what applies to them."""

    name: str = ""
    model_class: type[nn.Module] = nn.Module
    loss: str | None = None  # "next_token", or None: parallelize needs loss_fn

    def blocks(self, model: nn.Module) -> Blocks:
        raise NotImplementedError

    def layer_costs(self, model: nn.Module) -> LayerCosts:
        raise NotImplementedError

    def tp_plan(self, model: nn.Module) -> dict[str, str] | None:
        return None

    def check_tp(self, config: Any, tp: int) -> None:
        """ConfigError (no collective) if the model's shapes cannot be split over ``tp`` ranks."""

    def kv_heads(self, config: Any) -> int | None:
        return None

    def vocab_size(self, config: Any) -> int | None:
        return None

    def hidden_size(self, config: Any) -> int:
        raise ConfigError(f"{self.name} models cannot be decoded (no hidden size)")

    def kv_layer(self, name: str) -> bool:
        """Whether block ``name`` (a key of ``blocks``) takes a KV cache when decoding."""
        return False

    def kv_cache(self) -> Any:
        """A fresh KV cache for one ``kv_layer`` block, as its ``cache=`` argument takes it."""
        raise ConfigError(f"{self.name} models keep no KV cache")

    def attention_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        return {}

    def attention_windows(self, model: nn.Module) -> dict[str, int | None]:
        """For each of ``attention_modules``: the keys its queries see at most, themselves included (None: every
        earlier key)."""
        return dict.fromkeys(self.attention_modules(model))

    def tie_weights(self, model: nn.Module) -> None:
        """Re-tie shared parameters after their modules were replaced (sharded)."""

    def init_tensor(self, config: Any, key: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The initial value (float32, full ``shape``) of state tensor ``key`` for ``seed``."""
        raise ConfigError(f"{self.name} models have no seeded initialisation: load their weights instead "
                          "(load_full_state_dict, a checkpoint or a Hugging Face folder)")


class SequentialFamily(Family):
    """Any ``nn.Sequential``: every child is a layer; the caller gives ``loss_fn`` (and ``tp_plan`` for tp > 1)."""

    name = "sequential"
    model_class = nn.Sequential

    def blocks(self, model: nn.Module) -> Blocks:
        named = list(model.named_children())
        return Blocks(named, 0, len(named))

    def layer_costs(self, model: nn.Module) -> LayerCosts:
        return LayerCosts([float(sum(p.numel() for p in child.parameters()) + 1) for child in model.children()])


def attention_methods(name: str, module: nn.Module, refusal: str) -> dict[str, Callable]:
    """The ``core``, ``rope`` and ``rope_at`` of attention module ``name`` (one of a family's
    ``attention_modules``), which context parallelism and document masking shadow; a ConfigError ``refusal``
    (formatted with ``name`` and ``method``) for one it lacks."""
    methods: dict[str, Callable] = {}
    for method in ("core", "rope", "rope_at"):
        fn = getattr(module, method, None)
        if not callable(fn):
            raise ConfigError(refusal.format(name=name, method=method))
        methods[method] = fn
    return methods
