"""Qwen3-MoE: Qwen3 (per-head q/k RMSNorm) whose feed-forward layers are plait's mixture of experts.

transformers' ``Qwen3MoeSparseMoeBlock`` routes as plait.models.moe does: softmax over ``num_experts``, top-k,
and with ``norm_topk_prob`` the k gates renormalised (plait renormalises for k > 1 and gates by the raw
probability for k = 1, so a folder must say ``norm_topk_prob`` exactly when k > 1). Its tensor names are plait's
(``mlp.gate``, ``mlp.experts.i.gate_proj/up_proj/down_proj``); an expert's width is ``moe_intermediate_size``
(plait's ``ffn_dim``), and every layer is MoE (``decoder_sparse_step`` 1: plait.hf_config refuses dense layers
among them). Routing is dropless, and the training loss adds plait's per-sequence load-balancing loss
(``aux_loss_coef`` = ``router_aux_loss_coef``). With ``use_sliding_window`` every layer takes ``sliding_window``
(its configs name no per-layer kinds: transformers' Qwen3-MoE reads neither ``layer_types`` nor
``max_window_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import ConfigError
from plait.models.decoder import DecoderFamily
from plait.models.llama import Llama, LlamaConfig
from plait.models.qwen3 import Qwen3Config


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    n_experts: int = 128
    top_k: int = 8
    aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_experts < 2 or self.capacity_factor is not None:
            raise ConfigError(f"Qwen3MoeConfig: n_experts={self.n_experts} must be >= 2 and capacity_factor="
                              f"{self.capacity_factor} None (dropless)")


class Qwen3Moe(Llama):
    """A plain Qwen3-MoE decoder: Qwen3's attention with a mixture-of-experts feed-forward every moe_every layers."""


class Qwen3MoeFamily(DecoderFamily):
    name = model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    model_class, config_class = Qwen3Moe, Qwen3MoeConfig
    FEATURES = frozenset({"qk_norm", "experts", "sliding_window"})

    def check_hf(self, hf: dict) -> None:
        if hf.get("attention_bias"):
            raise ConfigError("attention_bias=true: plait runs Qwen3-MoE with bias-free attention projections only")

    def hf_extra(self, config: LlamaConfig) -> dict:
        if config.capacity_factor is not None or not config.qk_norm or config.moe_every != 1:
            raise ConfigError("a Qwen3-MoE folder needs every layer MoE (moe_every=1), dropless routing "
                              "(capacity_factor=None) and qk_norm=True")
        return {"num_experts": config.n_experts, "num_experts_per_tok": config.top_k,
                "intermediate_size": config.ffn_dim, "moe_intermediate_size": config.ffn_dim, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "norm_topk_prob": config.top_k > 1,
                "router_aux_loss_coef": config.aux_loss_coef, "output_router_logits": False,
                "attention_bias": False, "use_sliding_window": config.sliding_window is not None,
                "sliding_window": config.sliding_window}


FAMILY = Qwen3MoeFamily()
