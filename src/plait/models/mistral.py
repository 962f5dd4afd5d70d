"""Mistral: Llama with sliding-window attention (each query sees at most ``sliding_window`` keys, itself included)."""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import ConfigError
from plait.models.decoder import DecoderFamily
from plait.models.llama import Llama, LlamaConfig


@dataclass
class MistralConfig(LlamaConfig):
    """LlamaConfig whose ``sliding_window`` (None: full causal attention) is Mistral's own field."""


class Mistral(Llama):
    """A plain Mistral decoder: Llama's modules, attention limited to the last ``sliding_window`` positions."""


class MistralFamily(DecoderFamily):
    name = model_type = "mistral"
    architecture = "MistralForCausalLM"
    model_class, config_class = Mistral, MistralConfig
    FEATURES = frozenset({"sliding_window"})

    def check_hf(self, hf: dict) -> None:
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ConfigError("attention_bias/mlp_bias=true: Mistral's projections are bias-free in plait")

    def hf_extra(self, config: LlamaConfig) -> dict:
        return {"sliding_window": config.sliding_window}


FAMILY = MistralFamily()
