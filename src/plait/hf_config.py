"""The one reader of a Hugging Face ``config.json`` of the families plait runs, without torch: its LlamaConfig fields.

``llama_fields`` turns the dict into ``plait.models.LlamaConfig`` keyword arguments: the shapes every Llama-like
folder gives (an explicit ``head_dim`` included) and what its family's folders add (``FAMILY_FIELDS``: Mistral's
and Mixtral's window, Mixtral's experts, Qwen2's q/k/v biases, Qwen3's per-head q/k norms, Qwen3-MoE's both, the
Qwen families' windows on the layers their configs name).
plait's models build their config from it (``plait.models.hf.config_from_hf``, which also refuses what they do
not run: another activation, scaled RoPE, a family's own refusals), and the planner its ``plait.plan.Model``
(``Model.from_hf_config``, through ``Model.from_llama_config`` as ``plait train``'s prediction does), so a folder is
planned as plait builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plait.errors import ConfigError, is_integer

#: LlamaConfig field -> the config.json key every Llama-like folder gives it under
SHARED_KEYS = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
               "n_heads": "num_attention_heads", "ffn_dim": "intermediate_size"}
#: LlamaConfig field -> the config.json key of a size a folder may give (absent or null: LlamaConfig derives it)
OPTIONAL_KEYS = {"n_kv_heads": "num_key_value_heads", "head_dim": "head_dim"}
#: the context a folder without ``max_position_embeddings`` is read with
DEFAULT_CONTEXT = 2048


def count(key: str, value: Any) -> int:
    """``value`` of config.json's ``key`` as a positive integer (an integral float is one); ConfigError naming the
    key otherwise."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_integer(value):
        raise ConfigError(f"{key} = {value!r}: must be an integer")
    if value < 1:
        raise ConfigError(f"{key} = {value!r}: must be a positive integer")
    return int(value)


def _window(hf: dict) -> int | None:
    """Mistral's and Mixtral's ``sliding_window``: keys a query sees at most, itself included (null: causal)."""
    window = hf.get("sliding_window")
    return None if window is None else count("sliding_window", window)


#: the kinds of layer a ``layer_types`` list names: one that takes the sliding window, one that sees every earlier key
SLIDING, FULL = "sliding_attention", "full_attention"
#: transformers' Qwen2Config / Qwen3Config defaults of ``max_window_layers`` and ``sliding_window``
MAX_WINDOW_LAYERS, QWEN_WINDOW = 28, 4096

#: model_type -> the LlamaConfig fields its folders add to the shared ones
FAMILY_FIELDS: dict[str, Callable[[dict], dict[str, Any]]] = {
    "llama": lambda hf: {},
    "mistral": lambda hf: {"sliding_window": _window(hf)},
    "mixtral": lambda hf: {"n_experts": count("num_local_experts", hf.get("num_local_experts", 8)),
                           "top_k": count("num_experts_per_tok", hf.get("num_experts_per_tok", 2)),
                           "aux_loss_coef": hf.get("router_aux_loss_coef", 0.001), "sliding_window": _window(hf)},
    "qwen2": lambda hf: {"qkv_bias": True, **_qwen_windows(hf)},
    "qwen3": lambda hf: {"qk_norm": True, **_qwen_windows(hf)},
    "qwen3_moe": lambda hf: {**_qwen3_moe(hf), "sliding_window": _window({"sliding_window": QWEN_WINDOW, **hf})
                             if hf.get("use_sliding_window") else None},
}


def _qwen_windows(hf: dict) -> dict[str, Any]:
    """Qwen2's and Qwen3's windows, as transformers reads them: ``sliding_window`` only with ``use_sliding_window``;
    the layers that take it are those ``layer_types`` calls ``"sliding_attention"``, or without ``layer_types`` those
    from ``max_window_layers`` on. Read canonically: no window (every layer full) as ``sliding_window`` None, a window
    on every layer without ``layer_types``. ConfigError for sliding layers without a window (transformers refuses
    them too) or a ``layer_types`` of another length."""
    window = _window({"sliding_window": QWEN_WINDOW, **hf}) if hf.get("use_sliding_window") else None
    n_layers = count("num_hidden_layers", hf.get("num_hidden_layers"))
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", MAX_WINDOW_LAYERS)
        first = 0 if first == 0 else count("max_window_layers", first)
        types = [SLIDING if window is not None and i >= first else FULL for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {SLIDING, FULL}:
        raise ConfigError(f"layer_types = {types!r}: needs one of {SLIDING!r}, {FULL!r} per layer "
                          f"(num_hidden_layers = {n_layers})")
    if window is None and SLIDING in types:
        raise ConfigError(f"layer_types names {SLIDING!r} layers but use_sliding_window = "
                          f"{str(bool(hf.get('use_sliding_window'))).lower()}, sliding_window = "
                          f"{hf.get('sliding_window')!r}: set use_sliding_window = true and a sliding_window, or make "
                          f"every layer {FULL!r}")
    if window is None or SLIDING not in types:
        return {"sliding_window": None}
    return {"sliding_window": window, "layer_types": None if FULL not in types else tuple(types)}


def _qwen3_moe(hf: dict) -> dict[str, Any]:
    """Qwen3-MoE's fields: every layer's feed-forward is experts ``moe_intermediate_size`` wide (transformers 5 writes
    ``num_experts`` as ``num_local_experts``); ConfigError for dense layers among them and for gates plait's router
    does not give (it renormalises the chosen ones exactly when top-k > 1)."""
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"decoder_sparse_step={hf.get('decoder_sparse_step', 1)}, mlp_only_layers="
                          f"{hf.get('mlp_only_layers') or []}: plait runs Qwen3-MoE with experts in every layer; "
                          "valid: decoder_sparse_step=1, mlp_only_layers=[]")
    top_k = count("num_experts_per_tok", hf.get("num_experts_per_tok", 8))
    if bool(hf.get("norm_topk_prob", False)) != (top_k > 1):
        raise ConfigError(f"norm_topk_prob={str(bool(hf.get('norm_topk_prob', False))).lower()} with "
                          f"num_experts_per_tok={top_k}: plait renormalises the chosen gates when top-k > 1 and "
                          f"gates by the probability at top-1; valid: norm_topk_prob={str(top_k > 1).lower()}")
    return {"qk_norm": True, "top_k": top_k, "aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
            "n_experts": count("num_experts", hf.get("num_experts", hf.get("num_local_experts", 128))),
            "ffn_dim": count("moe_intermediate_size", hf.get("moe_intermediate_size", 768))}


def model_type(hf: dict) -> str:
    """The family a config.json names (``llama`` when it names none)."""
    return str(hf.get("model_type") or "llama")


def llama_fields(hf: dict, kind: str | None = None) -> dict[str, Any]:
    """The LlamaConfig keyword arguments of config.json dict ``hf``, read as a folder of family ``kind`` (default:
    the one it names, ``model_type``). KeyError naming a key of ``SHARED_KEYS`` it lacks (or holds null);
    ConfigError naming a key whose value is no size, or a family plait does not run."""
    kind = kind or model_type(hf)
    if kind not in FAMILY_FIELDS:
        raise ConfigError(f"model_type={kind!r} is not supported; supported model types: "
                          f"{', '.join(sorted(FAMILY_FIELDS))}")
    missing = next((key for key in SHARED_KEYS.values() if hf.get(key) is None), None)
    if missing is not None:
        raise KeyError(missing)
    fields = {field: count(key, hf[key]) for field, key in (*SHARED_KEYS.items(), *OPTIONAL_KEYS.items())
              if hf.get(key) is not None}
    context = hf.get("max_position_embeddings")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return {**fields, "max_seq_len": DEFAULT_CONTEXT if context is None else count("max_position_embeddings", context),
            "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), **FAMILY_FIELDS[kind](hf)}
