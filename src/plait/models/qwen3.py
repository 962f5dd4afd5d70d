"""Qwen3: Llama with an RMSNorm over each head of q and k (before RoPE), no q/k/v bias, explicit head size, and
optionally Qwen2's per-layer sliding window (``plait.models.qwen2.hf_windows``)."""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import ConfigError
from plait.models.decoder import DecoderFamily
from plait.models.llama import Llama, LlamaConfig
from plait.models.qwen2 import hf_windows


@dataclass
class Qwen3Config(LlamaConfig):
    qk_norm: bool = True


class Qwen3(Llama):
    """A plain Qwen3 decoder: Llama's modules with per-head q/k RMSNorm (``self_attn.q_norm`` / ``k_norm``)."""


class Qwen3Family(DecoderFamily):
    name = model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    model_class, config_class = Qwen3, Qwen3Config
    FEATURES = frozenset({"qk_norm", "sliding_window", "layer_windows"})

    def check_hf(self, hf: dict) -> None:
        if hf.get("attention_bias"):
            raise ConfigError("attention_bias=true: plait runs Qwen3 with bias-free attention projections only")

    def hf_extra(self, config: LlamaConfig) -> dict:
        if not config.qk_norm:
            raise ConfigError("qk_norm=False: Qwen3 folders always normalise q and k; save it as llama instead")
        return {"attention_bias": False, **hf_windows(config)}


FAMILY = Qwen3Family()
