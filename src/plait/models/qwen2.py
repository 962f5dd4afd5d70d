"""Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections (sharded with their columns under TP), and
optionally a sliding window on the layers the config names (``plait.hf_config``: ``use_sliding_window``,
``max_window_layers``, ``layer_types``)."""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import ConfigError
from plait.models.decoder import DecoderFamily
from plait.models.llama import Llama, LlamaConfig
from plait.models.window import LAYER_TYPES, SLIDING


def hf_windows(config: LlamaConfig) -> dict:
    """The config.json keys of Qwen2's and Qwen3's windows, as transformers reads them: ``use_sliding_window``,
    ``sliding_window``, ``layer_types`` and a ``max_window_layers`` that says the same where the sliding layers are
    the last ones (else the layer count: ``layer_types`` is what transformers reads)."""
    window, n = config.sliding_window, config.n_layers
    types = [LAYER_TYPES[config.window_of(i) is not None] for i in range(n)]
    first = types.index(SLIDING) if SLIDING in types else n
    contiguous = all(t == SLIDING for t in types[first:])
    return {"use_sliding_window": window is not None, "sliding_window": window, "layer_types": types,
            "max_window_layers": first if contiguous else n}


@dataclass
class Qwen2Config(LlamaConfig):
    qkv_bias: bool = True


class Qwen2(Llama):
    """A plain Qwen2 decoder: Llama's modules with q, k, v biases."""


class Qwen2Family(DecoderFamily):
    name = model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    model_class, config_class = Qwen2, Qwen2Config
    FEATURES = frozenset({"qkv_bias", "sliding_window", "layer_windows"})

    def hf_extra(self, config: LlamaConfig) -> dict:
        if not config.qkv_bias:
            raise ConfigError("qkv_bias=False: Qwen2 folders always carry q, k, v biases; save it as llama instead")
        return hf_windows(config)


FAMILY = Qwen2Family()
