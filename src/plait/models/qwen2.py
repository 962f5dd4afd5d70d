"""Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections (sharded with their columns under TP)."""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import ConfigError
from plait.models.decoder import DecoderFamily
from plait.models.llama import Llama, LlamaConfig


def refuse_sliding_layers(hf: dict) -> None:
    """Qwen's optional per-layer sliding windows are not run by plait: ConfigError if a folder turns them on."""
    layer_types = hf.get("layer_types") or []
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise ConfigError("use_sliding_window=true / sliding_attention layers: plait runs Qwen models with full "
                          "causal attention only")


@dataclass
class Qwen2Config(LlamaConfig):
    qkv_bias: bool = True


class Qwen2(Llama):
    """A plain Qwen2 decoder: Llama's modules with q, k, v biases."""


class Qwen2Family(DecoderFamily):
    name = model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    model_class, config_class = Qwen2, Qwen2Config
    FEATURES = frozenset({"qkv_bias"})

    def check_hf(self, hf: dict) -> None:
        refuse_sliding_layers(hf)

    def hf_extra(self, config: LlamaConfig) -> dict:
        if not config.qkv_bias:
            raise ConfigError("qkv_bias=False: Qwen2 folders always carry q, k, v biases; save it as llama instead")
        return {"use_sliding_window": False, "sliding_window": None}


FAMILY = Qwen2Family()
