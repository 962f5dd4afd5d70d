"""Plain model definitions (no parallelism inside): Llama and its relatives, one adapter per family.

``from_pretrained(dir)`` returns the plain model of whichever family a Hugging Face folder's
``config.json`` names (``model_type``: llama, mistral, qwen2, qwen3, mixtral, qwen3_moe).
"""

from plait.models.hf import load_pretrained as from_pretrained
from plait.models.init import init_weights
from plait.models.llama import Llama, LlamaConfig
from plait.models.mistral import Mistral, MistralConfig
from plait.models.mixtral import Mixtral, MixtralConfig
from plait.models.qwen2 import Qwen2, Qwen2Config
from plait.models.qwen3 import Qwen3, Qwen3Config
from plait.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig

__all__ = ["Llama", "LlamaConfig", "Mistral", "MistralConfig", "Mixtral", "MixtralConfig", "Qwen2", "Qwen2Config",
           "Qwen3", "Qwen3Config", "Qwen3Moe", "Qwen3MoeConfig", "from_pretrained", "init_weights"]
