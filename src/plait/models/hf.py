"""Hugging Face Llama folders (config.json + safetensors) to and from plait's plain ``Llama``; slice reads."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from plait.errors import ConfigError
from plait.models.llama import Llama, LlamaConfig

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def config_from_hf(hf: dict) -> LlamaConfig:
    """A LlamaConfig from a Hugging Face ``config.json`` dict; unsupported features raise ConfigError."""
    if hf.get("model_type", "llama") != "llama":
        raise ConfigError(f"model_type={hf.get('model_type')!r}: only Hugging Face 'llama' folders are supported")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"{flag}=true is not supported by plait.models.Llama (bias-free projections only)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={hf['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ConfigError(f"rope type {rope.get('rope_type', rope.get('type'))!r}: only default RoPE is supported")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise ConfigError(f"head_dim={head_dim} x heads={heads} != hidden_size={hf['hidden_size']}: unsupported")
    return LlamaConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_dim=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048), norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def config_to_hf(cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A ``config.json`` dict that transformers 4.x and 5.x read as the same Llama."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn_dim, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "torch_dtype": str(dtype).removeprefix("torch."), "bos_token_id": None,
        "eos_token_id": None,
    }


def hf_name(key: str) -> str:
    """plait key -> Hugging Face tensor name (``layers.0.mlp.up_proj.weight`` -> ``model.layers.0...``)."""
    return key if key.startswith("lm_head.") else f"model.{key}"


class HFWeights:
    """The safetensors files of a Hugging Face folder: full tensors or slices, reading only what is asked."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ConfigError(f"--model {self.path}: not a Hugging Face folder (no config.json there)")
        self.config = config_from_hf(json.loads((self.path / "config.json").read_text()))
        index = self.path / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise ConfigError(f"{self.path}: no *.safetensors files (pickled .bin weights are not read)")
            weight_map = {name: f.name for f in files for name in _names(f)}
        self.files: dict[str, Path] = {k: self.path / v for k, v in weight_map.items()}
        self._handles: dict[Path, object] = {}

    def _resolve(self, key: str) -> str:
        name = hf_name(key)
        if name not in self.files and key == "lm_head.weight" and self.config.tie_embeddings:
            name = "model.embed_tokens.weight"
        if name not in self.files:
            raise ConfigError(f"{self.path}: tensor {name!r} not found in the safetensors files")
        return name

    def _handle(self, file: Path):
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        return self._handles[file]

    def shape(self, key: str) -> list[int]:
        name = self._resolve(key)
        return list(self._handle(self.files[name]).get_slice(name).get_shape())

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor for plait key ``key``, or only ``[start, stop)`` along ``dim`` (a slice read)."""
        name = self._resolve(key)
        handle = self._handle(self.files[name])
        if dim is None:
            return handle.get_tensor(name)
        sl = handle.get_slice(name)
        index = tuple([slice(None)] * dim + [slice(start, stop)])
        return sl[index]


def _names(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())


def load_pretrained(path: str | Path, dtype: torch.dtype | None = None) -> Llama:
    """A plain Llama with the weights of a Hugging Face folder (GQA, tied or untied, rope theta, norm eps)."""
    weights = HFWeights(path)
    model = Llama(weights.config)
    state = {k: weights.read(k) for k in model.state_dict()}
    model.load_state_dict(state)
    return model.to(dtype) if dtype is not None else model


def save_state_dict_pretrained(cfg: LlamaConfig, state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write plain-key full tensors as a Hugging Face folder (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {hf_name(k): v.detach().contiguous().cpu() for k, v in state.items()
               if not (cfg.tie_embeddings and k == "lm_head.weight")}
    dtype = next(iter(tensors.values())).dtype
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype), indent=2) + "\n")


def save_pretrained(model: Llama, path: str | Path) -> None:
    save_state_dict_pretrained(model.config, model.state_dict(), path)
