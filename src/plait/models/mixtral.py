"""Mixtral: Llama whose every feed-forward layer is plait's mixture of experts (plait.models.moe).

The MoE layer is transformers' ``MixtralSparseMoeBlock``: softmax router over ``n_experts``, top-k with the
k gates renormalised, SwiGLU experts; Hugging Face names ``block_sparse_moe.gate`` and ``experts.i.w1/w3/w2``
are plait's ``mlp.gate`` and ``experts.i.gate_proj/up_proj/down_proj``. Routing is dropless. The training
loss adds plait's per-sequence load-balancing loss (``aux_loss_coef`` = ``router_aux_loss_coef``).
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import ConfigError
from plait.models.decoder import DecoderFamily
from plait.models.llama import Llama, LlamaConfig


@dataclass
class MixtralConfig(LlamaConfig):
    n_experts: int = 8
    top_k: int = 2
    aux_loss_coef: float = 0.001

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_experts < 2 or self.moe_every != 1 or self.capacity_factor is not None:
            raise ConfigError(f"MixtralConfig: n_experts={self.n_experts} must be >= 2, moe_every={self.moe_every} "
                              f"1 and capacity_factor={self.capacity_factor} None (dropless)")
        if self.top_k < 2:
            raise ConfigError(f"MixtralConfig.top_k={self.top_k}: Mixtral renormalises the chosen gates, so top-1 "
                              "would gate by 1.0 where plait's router gates by the probability; use top_k >= 2")


class Mixtral(Llama):
    """A plain Mixtral decoder: Llama's attention with a mixture-of-experts feed-forward in every layer."""


class MixtralFamily(DecoderFamily):
    name = model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    model_class, config_class = Mixtral, MixtralConfig
    FEATURES = frozenset({"experts", "sliding_window"})
    HF_RENAMES = ((r"\.mlp\.", ".block_sparse_moe."), (r"\.gate_proj\.", ".w1."), (r"\.up_proj\.", ".w3."),
                  (r"\.down_proj\.", ".w2."))

    def check_hf(self, hf: dict) -> None:
        if hf.get("router_jitter_noise"):
            raise ConfigError(f"router_jitter_noise={hf['router_jitter_noise']}: plait's router adds no noise; "
                              "use 0.0")

    def hf_extra(self, config: LlamaConfig) -> dict:
        if config.moe_every != 1 or config.capacity_factor is not None or config.top_k < 2:
            raise ConfigError("a Mixtral folder needs every layer MoE (moe_every=1), dropless routing "
                              "(capacity_factor=None) and top_k >= 2")
        return {"num_local_experts": config.n_experts, "num_experts_per_tok": config.top_k,
                "router_aux_loss_coef": config.aux_loss_coef, "router_jitter_noise": 0.0,
                "sliding_window": config.sliding_window, "output_router_logits": False}


FAMILY = MixtralFamily()
