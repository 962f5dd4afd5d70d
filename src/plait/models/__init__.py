"""Plain model definitions (no parallelism inside): the reference Llama and its presets."""

from plait.models.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
