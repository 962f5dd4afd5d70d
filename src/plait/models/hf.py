"""Hugging Face folders (config.json + safetensors) to and from plait's plain models, for every family; slice reads.

A ``config.json``'s fields, every Llama-like folder's and each family's own, are read by ``plait.hf_config``
(the planner's reader too); each family refuses what it does not run (``DecoderFamily.check_hf``), writes its
own keys (``hf_extra``) and renames tensors (``DecoderFamily.hf_name``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.errors import ConfigError
from plait.hf_config import llama_fields
from plait.models.decoder import DecoderFamily
from plait.models.registry import family_for_type

if TYPE_CHECKING:
    from plait.models.llama import LlamaConfig

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
#: the token ids of a config.json, which belong to the tokenizer beside it rather than to the weights
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def generation_token_ids(folder: Path) -> dict:
    """The TOKEN_IDS ``folder``'s generation_config.json sets (not null; {} without a readable one)."""
    try:
        config = json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in TOKEN_IDS if isinstance(config, dict) and config.get(k) is not None}


def read_config(path: str | Path) -> dict:
    """The config.json dict of a Hugging Face folder (ConfigError if there is none)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ConfigError(f"--model {path}: not a Hugging Face folder (no config.json there)")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--model {path}: {file} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--model {path}: {file} holds {type(config).__name__}, not a JSON object")
    return config


def folder_family(hf: dict) -> DecoderFamily:
    """The family a config.json's ``model_type`` names (``llama`` when absent)."""
    return family_for_type(hf.get("model_type", "llama"))


def config_from_hf(hf: dict, family: DecoderFamily | None = None) -> LlamaConfig:
    """The plait config of a Hugging Face ``config.json`` dict, its fields as ``plait.hf_config.llama_fields``
    reads them (the planner's reader too); what plait's models do not run raises ConfigError (here and in the
    family's ``check_hf``)."""
    family = family or folder_family(hf)
    if hf.get("model_type", family.model_type) != family.model_type:
        raise ConfigError(f"model_type={hf.get('model_type')!r}: this reads {family.model_type!r} folders; "
                          "plait.models.from_pretrained reads any supported family")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={hf['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ConfigError(f"rope type {rope.get('rope_type', rope.get('type'))!r}: only default RoPE is supported")
    family.check_hf(hf)
    return family.config_class(**llama_fields(hf, family.model_type))


def folder_config(path: str | Path, family: DecoderFamily | None = None) -> tuple[DecoderFamily, LlamaConfig]:
    """(family, plait config) of the Hugging Face folder ``path``: a config.json that lacks a key every folder of
    its family gives, names a type or feature plait does not read, or holds a value no model is built with is a
    ConfigError naming the folder and its config.json."""
    hf = read_config(path)
    try:
        family = family or folder_family(hf)
        return family, config_from_hf(hf, family)
    except KeyError as exc:
        raise ConfigError(f"--model {path}: config.json has no {exc.args[0]!r}, which every "
                          f"{hf.get('model_type', 'llama')} folder gives (a config.json written by hand, or cut "
                          "short?)") from None
    except ConfigError as exc:
        raise ConfigError(f"--model {path}: config.json: {exc}") from None


def config_to_hf(cfg: LlamaConfig, family: DecoderFamily, dtype: torch.dtype = torch.float32) -> dict:
    """A ``config.json`` dict that transformers 4.x and 5.x read as the same model."""
    family.check_features(cfg)
    return {
        "architectures": [family.architecture], "model_type": family.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn_dim, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."), "bos_token_id": None, "eos_token_id": None,
        **family.hf_extra(cfg),
    }


class HFWeights:
    """The safetensors files of a Hugging Face folder: full tensors or slices, reading only what is asked."""

    def __init__(self, path: str | Path, family: DecoderFamily | None = None):
        self.path = Path(path)
        self.family, self.config = folder_config(self.path, family)
        index = self.path / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"--model {self.path}: {INDEX_NAME} is damaged (no JSON weight_map: "
                                  f"{type(exc).__name__}: {exc}); copy the folder again") from None
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                there = ", ".join(sorted(f.name for f in self.path.iterdir())[:6])
                raise ConfigError(f"--model {self.path}: no weights in the folder (it holds {there}): a model folder "
                                  f"starts from its *.safetensors files, or {INDEX_NAME} and its shards; pickled "
                                  ".bin weights are not read. Add the weights (`plait export CHECKPOINT DIR` writes "
                                  "a whole folder), or start a fresh model from a preset (plait train --model tiny "
                                  "or small)")
            weight_map = {name: f.name for f in files for name in _names(f)}
        self.files: dict[str, Path] = {k: self.path / v for k, v in weight_map.items()}
        self._handles: dict[Path, object] = {}

    def _resolve(self, key: str) -> str:
        name = self.family.hf_name(key)
        if name not in self.files and key == "lm_head.weight" and self.config.tie_embeddings:
            name = "model.embed_tokens.weight"
        if name not in self.files:
            raise ConfigError(f"{self.path}: tensor {name!r} not found in the safetensors files")
        return name

    def _handle(self, file: Path):
        if file not in self._handles:
            self._handles[file] = _open(file, self.path)
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

    def check_shapes(self) -> None:
        """ConfigError naming the first tensor whose shape in the safetensors files is not the one config.json
        gives it (a folder whose weights belong to another model): read from the files' headers only."""
        with torch.device("meta"):
            model = self.family.model_class(self.config)
        for key, tensor in model.state_dict().items():
            got = self.shape(key)
            if got != list(tensor.shape):
                raise ConfigError(f"{self.path}: {self._resolve(key)} is {got} in its safetensors files, but its "
                                  f"config.json makes it {list(tensor.shape)}: the two describe different models")


def _open(file: Path, folder: Path):
    """A safetensors handle on ``file`` of the model folder ``folder``; a file missing or damaged (cut short by a
    copy or a download that stopped) is a ConfigError naming it, not a traceback."""
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise ConfigError(f"--model {folder}: {file.name} is missing, though {INDEX_NAME} lists it (a folder "
                          "copied or downloaded in part?)")
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as exc:
        raise ConfigError(f"--model {folder}: {file.name} cannot be read ({exc}): the file is damaged or was cut "
                          "short (a copy or download that stopped?)") from None


def _names(file: Path) -> list[str]:
    with _open(file, file.parent) as f:
        return list(f.keys())


def load_pretrained(path: str | Path, family: DecoderFamily | None = None, dtype: torch.dtype | None = None
                    ) -> nn.Module:
    """The plain model of a Hugging Face folder, of ``family`` (default: whichever config.json names)."""
    weights = HFWeights(path, family)
    model = weights.family.model_class(weights.config)
    state = {k: weights.read(k) for k in model.state_dict()}
    model.load_state_dict(state)
    return model.to(dtype) if dtype is not None else model


def check_weights_out(out: Path) -> None:
    """ConfigError when folder ``out`` holds weights other than a model.safetensors (shards and their index, .bin
    files), which a reader would take instead of (or beside) the model.safetensors written there."""
    others = sorted(f.name for f in out.glob("*") if f.name != WEIGHTS_NAME and (
        f.suffix in (".safetensors", ".bin", ".pt", ".pth") or f.name.endswith(".index.json")))
    if others:  # an index would send readers to its shards: the old weights, not these
        raise ConfigError(f"{out}: holds other weights ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}), "
                          f"which a reader would take instead of (or beside) the {WEIGHTS_NAME} written here; write "
                          "to a folder without them")


def save_state_dict_pretrained(family: DecoderFamily, cfg: LlamaConfig, state: dict[str, torch.Tensor],
                               path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write plain-key full tensors as a Hugging Face folder (config.json + model.safetensors, whose metadata
    also holds ``metadata``)."""
    from safetensors.torch import save_file

    meta = config_to_hf(cfg, family)  # fails (ConfigError) before anything is written
    out = Path(path)
    check_weights_out(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {family.hf_name(k): v.detach().contiguous().cpu() for k, v in state.items()
               if not (cfg.tie_embeddings and k == "lm_head.weight")}
    dtype = next(iter(tensors.values())).dtype
    meta["torch_dtype"] = str(dtype).removeprefix("torch.")
    try:  # the folder's token ids (a model saved back where it was read from, beside its tokenizer) stay
        before = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        before = None
    if isinstance(before, dict):
        meta.update({k: before[k] for k in TOKEN_IDS if before.get(k) is not None})
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={**(metadata or {}), "format": "pt"})
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
