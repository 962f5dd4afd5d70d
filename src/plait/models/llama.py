"""A plain Llama decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention); no parallelism inside.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` without the ``model.`` prefix, so weights
map one to one. Layers read their head counts from their projections' actual sizes, which lets a
layout shard them from outside without touching ``forward``. The same modules build the Llama-like
families (plait.models.mistral, qwen2, qwen3, mixtral) through the optional features of ``LlamaConfig``:
an explicit head size, biases on q/k/v, per-head RMSNorm on q and k, sliding-window attention, and
mixture-of-experts feed-forward layers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import ConfigError, is_integer, is_number, plain_numbers
from plait.models.decoder import DecoderFamily
from plait.models.init import tensor_generator
from plait.models.kv_cache import KVCache
from plait.models.moe import MoE, check_moe_config, pop_aux_losses
from plait.models.rotary import RotaryTables, rotate
from plait.models.window import check_layer_types, layer_window, window_mask


@dataclass
class LlamaConfig:
    """The shapes and features of a Llama-like model. ``n_kv_heads``, ``ffn_dim`` and ``head_dim`` may be given as
    None: ``__post_init__`` derives them, so they are always ints afterwards (hence their annotations)."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = None  # type: ignore[assignment]  # None: n_heads
    ffn_dim: int = None  # type: ignore[assignment]  # None: Llama's rule from dim
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    head_dim: int = None  # type: ignore[assignment]  # None: dim // n_heads
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # each query sees at most this many keys, itself included (Mistral)
    # per layer "sliding_attention" (takes sliding_window) or "full_attention"; None: every layer (plait.models.window)
    layer_types: tuple[str, ...] | None = None
    # mixture of experts (plait.models.moe): layer i is MoE when n_experts > 1 and i % moe_every == moe_every - 1
    n_experts: int = 1
    top_k: int = 1
    moe_every: int = 1
    capacity_factor: float | None = None  # None: dropless; c: each expert takes <= ceil(c*S*k/E) per sequence
    aux_loss_coef: float = 0.01  # load-balancing loss weight (Fedus et al. 2021 use 0.01)

    def __post_init__(self) -> None:
        plain_numbers(self)
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len", "head_dim",
                     "sliding_window", "n_experts", "top_k", "moe_every"):
            value = getattr(self, name)
            if value is not None and (not is_integer(value) or value < 1):
                raise ConfigError(f"LlamaConfig.{name}={value!r} must be a positive integer")
        for name in ("tie_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"LlamaConfig.{name}={getattr(self, name)!r} must be True or False")
        for name, strict in (("rope_theta", True), ("norm_eps", False), ("init_std", False)):
            value = getattr(self, name)
            if not (is_number(value) and (value > 0 if strict else value >= 0)):
                raise ConfigError(f"LlamaConfig.{name}={value!r} must be a number {'> 0' if strict else '>= 0'}")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_dim is None:  # Llama's rule: 2/3 of 4*dim, rounded up to a multiple of 8
            self.ffn_dim = 8 * ((int(2 * 4 * self.dim / 3) + 7) // 8)
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError(f"LlamaConfig.n_heads={self.n_heads} must divide dim={self.dim} (or set head_dim)")
            self.head_dim = self.dim // self.n_heads
        if self.head_dim % 2:
            raise ConfigError(f"LlamaConfig.head_dim={self.head_dim} must be even (rotary embeddings)")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"LlamaConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        check_moe_config(self)
        self.layer_types = check_layer_types(self.layer_types, self.n_layers, self.sliding_window)

    def window_of(self, index: int) -> int | None:
        """The sliding window of layer ``index`` (None: it sees every earlier key)."""
        return layer_window(self.sliding_window, self.layer_types, index)

    def is_moe_layer(self, index: int) -> bool:
        return self.n_experts > 1 and index % self.moe_every == self.moe_every - 1

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): x / rms(x) * w.

    x is normalised in float32 by torch's ``rms_norm`` (one fused kernel forward and one backward on a GPU; the
    same pow, mean, rsqrt and product elsewhere), cast back to x's dtype, then scaled by w: transformers'
    LlamaRMSNorm, rounding for rounding."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class RowCache(Protocol):
    """A per-row cache (see ``plait.models.kv_cache.KVCache``): rows of one batch may sit at different positions."""

    def positions(self, s: int) -> torch.Tensor: ...

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]: ...


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings (Su et al. 2021); optional q/k/v
    biases, per-head q/k RMSNorm and a sliding window (query at position i sees keys j with i - W < j <= i), the one
    of layer ``index``."""

    _rope_device: torch.Tensor  # a registered buffer

    def __init__(self, cfg: LlamaConfig, rotary: RotaryTables | None = None, index: int = 0):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim, self.sliding_window = hd, cfg.window_of(index)
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps)
            self.k_norm = RMSNorm(hd, cfg.norm_eps)
        # the model's layers share one (plait.models.rotary): a forward builds the cos/sin tables once
        self.rotary = RotaryTables(hd, cfg.rope_theta) if rotary is None else rotary
        # a device anchor for the RoPE tables, whose frequencies are float32 whatever the model's dtype
        self.register_buffer("_rope_device", torch.zeros(0), persistent=False)

    def inv_freq(self) -> torch.Tensor:
        """RoPE frequencies theta^(-2i/hd), always float32 (a bf16 copy would blur long positions)."""
        return self.rotary.inv_freq(self._rope_device.device)  # [hd/2]

    def rope(self, seq_len: int, offset: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [S, hd] at positions offset..offset+S-1 (``plait.models.rotary.rotate``)."""
        return self.rotary.rope(seq_len, offset, dtype, self._rope_device.device)

    def rope_at(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [B, 1, S, hd] at per-row positions ``pos`` [B, S]."""
        return self.rotary.rope_at(pos, dtype, self._rope_device.device)

    def heads(self, x: torch.Tensor, proj: nn.Module, norm: nn.Module | None = None) -> torch.Tensor:
        """[B, S, H] -> [B, heads, S, hd] (the heads this projection holds), then per-head RMSNorm if any."""
        b, s, _ = x.shape
        y = proj(x).view(b, s, -1, self.head_dim)  # [B, S, heads, hd]
        return (y if norm is None else norm(y)).transpose(1, 2)

    def forward(self, x: torch.Tensor, cache: KVCache | RowCache | None = None) -> torch.Tensor:  # x: [B, S, H]
        b, s, _ = x.shape
        offset = cache.length if isinstance(cache, KVCache) else 0
        q = self.heads(x, self.q_proj, getattr(self, "q_norm", None))  # [B, h, S, hd]
        k = self.heads(x, self.k_proj, getattr(self, "k_norm", None))  # [B, h_kv, S, hd]
        v = self.heads(x, self.v_proj)
        mask: torch.Tensor | None = None
        pos: torch.Tensor | None = None
        if cache is None or isinstance(cache, KVCache):
            cos, sin = self.rope(s, offset, q.dtype)
        else:  # a per-row cache: each row's new tokens sit at its own positions
            pos = cache.positions(s)  # [B, S]
            cos, sin = self.rope_at(pos, q.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if cache is not None:  # [B, h_kv, L, hd], mask [S, L] or per row [B, 1, S, L] (None: L keys, causal)
            k, v, mask = cache.append(k, v)
        # a window as long as the keys hides none of them: the causal mask (SDPA's own, no mask built)
        if self.sliding_window is not None and self.sliding_window < k.shape[2]:
            pos = pos if pos is not None else torch.arange(offset, offset + s)  # [S]
            mask = window_mask(pos.to(q.device), k.shape[2], self.sliding_window)
        elif mask is None and offset > 0 and s > 1:  # query i sits at position offset + i, sees keys 0..offset + i
            mask = torch.ones(s, offset + s, dtype=torch.bool, device=q.device).tril(diagonal=offset)
        # one new token after the cached ones sees every key: no mask, and not SDPA's (top-left) causal one
        causal = not (mask is None and offset > 0)
        out = self.core(q, k, v, mask, causal)  # [B, h, S, hd]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             causal: bool = True) -> torch.Tensor:
        """softmax(q k^T / sqrt(hd)) v with the KV heads shared by groups of query heads (SDPA's ``enable_gqa``:
        K and V [B, h_kv, L, hd] are never repeated to every query head); with no mask causal (query i sees
        keys 0..i) unless ``causal`` is False (every query sees every key)."""
        gqa = q.shape[1] != k.shape[1]
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, cfg: LlamaConfig, index: int = 0, rotary: RotaryTables | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg, rotary, index)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg) if not cfg.is_moe_layer(index) else MoE(
            cfg.dim, cfg.ffn_dim, cfg.n_experts, cfg.top_k, cfg.capacity_factor, cfg.aux_loss_coef)

    def forward(self, x: torch.Tensor, cache: KVCache | RowCache | None = None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cache=cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    """Decoder-only language model: embed_tokens -> layers -> norm -> lm_head; forward gives logits."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        # built from an uninitialised tensor: reset_parameters draws it (nn.Embedding's own init would run
        # normal_, which on the meta device imports PyTorch's compiler stack, seconds of start-up)
        self.embed_tokens = nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, cfg.dim), freeze=False)
        rotary = RotaryTables(cfg.head_dim, cfg.rope_theta)  # shared by every layer's attention
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw from the global generator, module by module (``plait.models.init.init_weights(model, seed)``
        draws each tensor from its own seeded generator instead, with the rule of ``initial_tensor``)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and not module.weight.is_meta:  # meta: nothing to draw
                nn.init.normal_(module.weight, std=self.config.init_std)
                bias = getattr(module, "bias", None)
                if isinstance(bias, torch.Tensor):
                    nn.init.zeros_(bias)

    @staticmethod
    def initial_tensor(cfg: LlamaConfig, key: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The seeded initial value of state tensor ``key`` (float32, full shape): norm weights 1, biases 0,
        every other weight N(0, init_std²) from the generator of (seed, key) — a tied head the embedding's."""
        if key.endswith("norm.weight"):
            return torch.ones(shape)
        if key.endswith(".bias"):
            return torch.zeros(shape)
        if not key.endswith(".weight"):
            raise ConfigError(f"{key}: no initial value is defined for it (weights and biases only)")
        if cfg.tie_embeddings and key == "lm_head.weight":
            key = "embed_tokens.weight"
        return torch.empty(shape).normal_(0.0, cfg.init_std, generator=tensor_generator(seed, key))

    def forward(self, tokens: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, V]; with ``caches`` (one per layer) tokens follow the cached ones."""
        h = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            h = layer(h) if caches is None else layer(h, cache=caches[i])
        return self.lm_head(self.norm(h))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Mean next-token cross-entropy over non-ignored targets, plus the MoE load-balancing loss (mean over
        sequences, summed over layers; plait.models.moe)."""
        logits = self(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index)
        aux = pop_aux_losses(self)
        return loss if aux is None else loss + aux / tokens.shape[0]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None) -> Llama:
        """Load a Hugging Face folder of this class's family (config.json + *.safetensors); ``plait.models.hf``."""
        from plait.models.hf import load_pretrained

        model = load_pretrained(path, _decoder_family(cls), dtype=dtype)
        assert isinstance(model, cls)
        return model

    def save_pretrained(self, path: str | Path) -> None:
        """Write a Hugging Face folder (config.json + model.safetensors) that ``transformers`` loads."""
        from plait.models.hf import save_state_dict_pretrained

        save_state_dict_pretrained(_decoder_family(type(self)), self.config, self.state_dict(), path)


def _decoder_family(cls: type) -> DecoderFamily:
    from plait.models.registry import family_of_class

    family = family_of_class(cls)
    if not isinstance(family, DecoderFamily):  # a subclass registered as something else
        raise ConfigError(f"{cls.__name__}: its family {family.name!r} has no Hugging Face format")
    return family


# The tensor-parallel plan of Llama's modules, applied from outside (plait.tensor_parallel.plan, whose styles
# these are); "layers.*" patterns match every decoder layer
TP_PLAN: dict[str, str] = {
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


class LlamaFamily(DecoderFamily):
    """Hugging Face ``llama`` folders (``LlamaForCausalLM``): bias-free projections, dense SwiGLU."""

    name = model_type = "llama"
    architecture = "LlamaForCausalLM"
    model_class, config_class = Llama, LlamaConfig

    def check_hf(self, hf: dict) -> None:
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ConfigError(f"{flag}=true is not supported by plait.models.Llama (bias-free projections only)")

    def hf_extra(self, config: LlamaConfig) -> dict:
        return {"attention_bias": False, "mlp_bias": False}


FAMILY = LlamaFamily()
