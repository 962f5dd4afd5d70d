"""The adapter of decoder-only language models built from Llama's modules (Llama, Mistral, Qwen2, Qwen3,
Mixtral): blocks, layer costs, the tensor-parallel plan (``plait.models.llama.TP_PLAN``), KV layers, and the
translation of Hugging Face ``config.json`` files and tensor names."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from plait.errors import ConfigError, divisors
from plait.models.family import Blocks, Family, LayerCosts

if TYPE_CHECKING:
    from plait.models.kv_cache import KVCache
    from plait.models.llama import Llama


class DecoderFamily(Family):
    """Decoder-only language models built from plait.models.llama's modules: embed_tokens, layers, norm, lm_head.

    A Hugging Face family sets ``model_type``/``architecture`` and overrides ``check_hf`` (ConfigError on what
    a config.json says that it cannot run; the fields its folders add are read by ``plait.hf_config``),
    ``hf_extra`` (config -> extra config.json keys) and ``HF_RENAMES`` (plait tensor-name -> HF, regexes).
    """

    name = "llama"
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    config_class: type = object
    model_class: type[Llama]  # each family sets it: Llama or a subclass
    loss = "next_token"
    HF_RENAMES: tuple[tuple[str, str], ...] = ()
    #: optional LlamaConfig features this family's config.json can express
    FEATURES: frozenset[str] = frozenset()

    # ------------------------------------------------------------------------------ runtime seam
    def blocks(self, model: nn.Module) -> Blocks:
        model = _decoder(model)
        named: list[tuple[str, nn.Module]] = [("embed_tokens", model.embed_tokens)]
        named += [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
        named += [("norm", model.norm), ("lm_head", model.lm_head)]
        return Blocks(named, 1, len(model.layers))

    def layer_costs(self, model: nn.Module) -> LayerCosts:
        """Multiply-accumulates per token, counted as the planner counts them (``pipeline.balance``): a
        layer's projection weights a token uses (top-k experts and the router in a mixture-of-experts
        layer) plus attention scores and weighted sum, 2·S·dim at the model's max_seq_len; the head V·dim
        plus the softmax; the embedding lookup. From the config: the same before and after sharding."""
        from plait.pipeline.balance import embedding_macs, head_macs, layer_macs

        model = _decoder(model)
        cfg = model.config
        attention = 2 * cfg.dim * cfg.n_heads * cfg.head_dim + 2 * cfg.dim * cfg.n_kv_heads * cfg.head_dim
        mlp = 3 * cfg.dim * cfg.ffn_dim
        moe = cfg.top_k * mlp + cfg.dim * cfg.n_experts
        layers = [layer_macs(attention + (moe if cfg.is_moe_layer(i) else mlp), cfg.max_seq_len, cfg.dim)
                  for i in range(cfg.n_layers)]
        return LayerCosts(layers, embedding_macs(cfg.dim), head_macs(cfg.vocab_size, cfg.dim))

    def tp_plan(self, model: nn.Module) -> dict[str, str]:
        from plait.models.llama import TP_PLAN

        return TP_PLAN

    def check_tp(self, config: Any, tp: int) -> None:
        if config.n_heads % tp:
            raise ConfigError(f"tp={tp} must divide n_heads={config.n_heads}; valid tp: {divisors(config.n_heads)}")
        kv = config.n_kv_heads
        if kv % tp and tp % kv:
            valid = sorted(set(divisors(kv)) | {m for m in divisors(config.n_heads) if m % kv == 0})
            raise ConfigError(f"tp={tp} and n_kv_heads={kv}: tp must divide n_kv_heads or be a multiple of it "
                              f"(KV heads are then replicated); valid tp: {valid}")
        if config.ffn_dim % tp:
            raise ConfigError(f"tp={tp} must divide ffn_dim={config.ffn_dim}; valid tp: "
                              f"{divisors(config.ffn_dim)[:12]}")

    def kv_heads(self, config: Any) -> int:
        return config.n_kv_heads

    def vocab_size(self, config: Any) -> int:
        return config.vocab_size

    def hidden_size(self, config: Any) -> int:
        return config.dim

    def kv_layer(self, name: str) -> bool:
        return name.startswith("layers.")

    def kv_cache(self) -> KVCache:
        from plait.models.kv_cache import KVCache

        return KVCache()

    def attention_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        layers = _decoder(model).layers
        return {f"layers.{i}.self_attn": layer.get_submodule("self_attn") for i, layer in enumerate(layers)}

    def attention_windows(self, model: nn.Module) -> dict[str, int | None]:
        cfg = _decoder(model).config
        return {f"layers.{i}.self_attn": cfg.window_of(i) for i in range(cfg.n_layers)}

    def tie_weights(self, model: nn.Module) -> None:
        model = _decoder(model)
        if model.config.tie_embeddings:
            model.lm_head.weight = model.embed_tokens.weight  # the same (vocabulary-sharded) parameter

    def init_tensor(self, config: Any, key: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        rule = getattr(self.model_class, "initial_tensor", None)
        if rule is None:
            raise ConfigError(f"{self.name}: {self.model_class.__name__} has no initial_tensor(config, key, shape, "
                              "seed) rule for seeded initialisation")
        return rule(config, key, shape, seed)

    # ------------------------------------------------------------------------------ Hugging Face
    def check_hf(self, hf: dict) -> None:
        """ConfigError for what a config.json dict of this family says that plait's model does not run (its
        fields, this family's included, are ``plait.hf_config.llama_fields``)."""

    def hf_extra(self, config: Any) -> dict:
        """Family-specific config.json keys."""
        return {}

    def check_features(self, config: Any) -> None:
        """ConfigError if ``config`` uses a feature this family's config.json cannot express."""
        used = {"qkv_bias": config.qkv_bias, "qk_norm": config.qk_norm,
                "sliding_window": config.sliding_window is not None, "experts": config.n_experts > 1,
                "layer_windows": config.layer_types is not None}
        bad = sorted(k for k, on in used.items() if on and k not in self.FEATURES)
        if bad:
            from plait.models.registry import hf_families

            others = sorted(f.model_type for f in hf_families().values() if set(bad) <= f.FEATURES)
            raise ConfigError(f"{', '.join(bad)}: a Hugging Face {self.model_type!r} folder cannot express "
                              f"{'it' if len(bad) == 1 else 'them'}; families that can: {', '.join(others) or 'none'}")

    def hf_name(self, key: str) -> str:
        """plait key -> Hugging Face tensor name (``layers.0.mlp.up_proj.weight`` -> ``model.layers.0...``)."""
        for pattern, repl in self.HF_RENAMES:
            key = re.sub(pattern, repl, key)
        return key if key.startswith("lm_head.") else f"model.{key}"


def _decoder(model: nn.Module) -> Llama:
    """``model`` as what a DecoderFamily handles (a Llama or one of its subclasses), for the type checker."""
    return cast("Llama", model)
