"""The explicit registry of model families: Hugging Face ``model_type`` -> the module whose ``FAMILY`` adapts it.

As vLLM's model registry: the table is written out (a new family is one line here), and a family's module is
imported only when it is looked up. ``nn.Sequential`` has its own family, outside the table (no ``model_type``).
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from plait.errors import ConfigError
from plait.models.decoder import DecoderFamily
from plait.models.family import Family, SequentialFamily

#: Hugging Face ``model_type`` -> the plait.models module defining its ``FAMILY`` (a ``DecoderFamily``)
MODEL_TYPES: dict[str, str] = {
    "llama": "plait.models.llama",
    "mistral": "plait.models.mistral",
    "mixtral": "plait.models.mixtral",
    "qwen2": "plait.models.qwen2",
    "qwen3": "plait.models.qwen3",
    "qwen3_moe": "plait.models.qwen3_moe",
}

SEQUENTIAL = SequentialFamily()


def family_for_type(model_type: str | None) -> DecoderFamily:
    """The family of a Hugging Face ``model_type``; ConfigError listing the supported ones."""
    module = MODEL_TYPES.get(model_type or "")
    if module is None:
        raise ConfigError(f"model_type={model_type!r} is not supported; supported model types: "
                          f"{', '.join(sorted(MODEL_TYPES))}")
    family = importlib.import_module(module).FAMILY
    if not isinstance(family, DecoderFamily) or family.model_type != model_type:
        raise TypeError(f"{module}.FAMILY is not the DecoderFamily of model_type {model_type!r}")
    return family


def hf_families() -> dict[str, DecoderFamily]:
    """model_type -> family, for Hugging Face folders (every registered family)."""
    return {t: family_for_type(t) for t in MODEL_TYPES}


def families() -> list[Family]:
    """Every family: nn.Sequential's, then the registered ones."""
    return [SEQUENTIAL, *hf_families().values()]


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
    registered = hf_families().values()
    for base in type(config).__mro__:
        for family in registered:
            if family.config_class is base:
                return family
    raise ConfigError(f"{type(config).__name__} is not the config of a known model family")


def folder_family_of_config(config: Any) -> tuple[DecoderFamily, Any]:
    """(family, config) to write ``config`` as a Hugging Face folder: its own family where that family's
    config.json expresses every feature it uses, else the first family whose config class extends its own and
    whose folders express them, with ``config`` as that family's (a Llama with experts, which ``plait train
    --experts`` builds, is a Mixtral: the same modules and tensors); else its own family's ConfigError."""
    family = family_of_config(config)
    try:
        family.check_features(config)
        return family, config
    except ConfigError as exc:
        refusal = exc
    for other in hf_families().values():
        if other is family or not issubclass(other.config_class, type(config)):
            continue
        try:
            converted = other.config_class(**config.to_dict())
            other.check_features(converted)
            other.hf_extra(converted)
        except (ConfigError, TypeError):
            continue
        return other, converted
    raise refusal
