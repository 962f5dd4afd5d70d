"""The model seam: what the parallel runtime needs from a model, one adapter per family, and their registry.

A family adapter answers, for the models of one class, without the runtime ever naming that class:
  blocks             the model as named blocks in execution order (pipeline chunks are cut between them),
                     which of them are the repeated layers, and each layer's relative cost (balanced cuts)
  tp_plan, check_tp  the module-path tensor-parallel plan (plait.tensor_parallel.plan) and which tp the
                     shapes allow; kv_heads for grouped-query K/V projections
  loss               the default training loss: "next_token" (cross-entropy over vocabulary logits, computed
                     on vocabulary shards) or None (the caller passes ``loss_fn``)
  kv_layer           which blocks keep a KV cache when decoding; hidden_size: what flows between stages
  attention_modules  the attention module of every layer (whose core may be recomputed alone, and whose rope
                     and core context parallelism shadows); sliding_window: how far back a query sees
  tie_weights        re-tie shared parameters after sharding replaced modules
  init_tensor        the seeded initial value of one full state tensor (plait.models.init), so any layout
                     can initialise its shards one tensor at a time
Hugging Face families (``DecoderFamily`` subclasses) also translate ``config.json`` and tensor names
(``plait.models.hf``). Families are found by scanning ``plait.models`` for a module-level ``FAMILY``, so
adding one is one file: a config and model class (usually Llama's with some features on) and its FAMILY.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.models.llama import Llama


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

    def attention_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        return {}

    def sliding_window(self, config: Any) -> int | None:
        """Keys each query sees at most, itself included (None: every earlier key)."""
        return None

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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# "layers.*" patterns match every decoder layer; styles: plait.tensor_parallel.plan
DECODER_TP_PLAN: dict[str, str] = {
    "embed_tokens": "vocab_embed",
    "layers.*.input_layernorm": "sp_norm",
    "layers.*.self_attn": "region",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise_kv",
    "layers.*.self_attn.v_proj": "colwise_kv",
    "layers.*.self_attn.q_norm": "tp_partial",  # one [hd] weight shared by heads that live on different ranks
    "layers.*.self_attn.k_norm": "tp_partial",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.post_attention_layernorm": "sp_norm",
    "layers.*.mlp": "region",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "norm": "sp_norm",
    "lm_head": "vocab_head",
}


class DecoderFamily(Family):
    """Decoder-only language models built from plait.models.llama's modules: embed_tokens, layers, norm, lm_head.

    A Hugging Face family sets ``model_type``/``architecture`` and overrides ``hf_fields`` (config.json ->
    config keyword arguments beyond the shared ones, raising ConfigError on what it cannot run),
    ``hf_extra`` (config -> extra config.json keys) and ``HF_RENAMES`` (plait tensor-name -> HF, regexes).
    """

    name = "llama"
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    config_class: type = object
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
        return DECODER_TP_PLAN

    def check_tp(self, config: Any, tp: int) -> None:
        if config.n_heads % tp:
            raise ConfigError(f"tp={tp} must divide n_heads={config.n_heads}; valid tp: {_divisors(config.n_heads)}")
        kv = config.n_kv_heads
        if kv % tp and tp % kv:
            valid = sorted(set(_divisors(kv)) | {m for m in _divisors(config.n_heads) if m % kv == 0})
            raise ConfigError(f"tp={tp} and n_kv_heads={kv}: tp must divide n_kv_heads or be a multiple of it "
                              f"(KV heads are then replicated); valid tp: {valid}")
        if config.ffn_dim % tp:
            raise ConfigError(f"tp={tp} must divide ffn_dim={config.ffn_dim}; valid tp: "
                              f"{_divisors(config.ffn_dim)[:12]}")

    def kv_heads(self, config: Any) -> int:
        return config.n_kv_heads

    def vocab_size(self, config: Any) -> int:
        return config.vocab_size

    def hidden_size(self, config: Any) -> int:
        return config.dim

    def kv_layer(self, name: str) -> bool:
        return name.startswith("layers.")

    def attention_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        layers = _decoder(model).layers
        return {f"layers.{i}.self_attn": layer.get_submodule("self_attn") for i, layer in enumerate(layers)}

    def sliding_window(self, config: Any) -> int | None:
        return config.sliding_window

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
    def hf_fields(self, hf: dict) -> dict:
        """Family-specific config keyword arguments from a config.json dict (ConfigError if unsupported)."""
        return {}

    def hf_extra(self, config: Any) -> dict:
        """Family-specific config.json keys."""
        return {}

    def check_features(self, config: Any) -> None:
        """ConfigError if ``config`` uses a feature this family's config.json cannot express."""
        used = {"qkv_bias": config.qkv_bias, "qk_norm": config.qk_norm,
                "sliding_window": config.sliding_window is not None, "experts": config.n_experts > 1}
        bad = sorted(k for k, on in used.items() if on and k not in self.FEATURES)
        if bad:
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


def families() -> list[Family]:
    """Every registered family: nn.Sequential's and each ``FAMILY`` of a plait.models module."""
    import plait.models as pkg

    found: list[Family] = [SequentialFamily()]
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        family = getattr(importlib.import_module(f"plait.models.{info.name}"), "FAMILY", None)
        if isinstance(family, Family):
            found.append(family)
    return found


def family_of_class(cls: type) -> Family:
    """The family of a model class (the most specific registered base class)."""
    registered = families()
    for base in cls.__mro__:
        for family in registered:
            if family.model_class is base:
                return family
    names = ", ".join(f.model_class.__name__ for f in registered)
    raise ConfigError(f"{cls.__name__} is not a model plait can parallelize: use one of {names} "
                      "(or an nn.Sequential with loss_fn)")


def family_of(model: nn.Module) -> Family:
    return family_of_class(type(model))


def family_of_config(config: Any) -> DecoderFamily:
    """The family whose config class ``config`` is (e.g. a Qwen2Config -> qwen2); its ``model_class`` builds it."""
    registered = [f for f in families() if isinstance(f, DecoderFamily)]
    for base in type(config).__mro__:
        for family in registered:
            if family.config_class is base:
                return family
    raise ConfigError(f"{type(config).__name__} is not the config of a known model family")


def hf_families() -> dict[str, DecoderFamily]:
    """model_type -> family, for Hugging Face folders."""
    return {f.model_type: f for f in families() if isinstance(f, DecoderFamily)}


def family_for_type(model_type: str | None) -> DecoderFamily:
    """The family of a Hugging Face ``model_type``; ConfigError listing the supported ones."""
    known = hf_families()
    if model_type not in known:
        raise ConfigError(f"model_type={model_type!r} is not supported; supported model types: "
                          f"{', '.join(sorted(known))}")
    return known[model_type]

