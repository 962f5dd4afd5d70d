"""plait: plan, simulate, run and verify 3D/expert parallelism for transformers on torch.distributed.

Importing ``plait`` does not import torch: the torch-backed names (``init``, ``parallelize``, ``generate``,
``models``, ...) are loaded on first use so that ``plait.schedules``, ``plait.sim`` and ``plait.plan``
start instantly. ``plait.parallelize`` and ``plait.generate`` are functions (from ``plait.parallelization``
and ``plait.generation``).
"""

from __future__ import annotations

import importlib
from typing import Any

from plait.errors import CommError, CommTimeoutError, ConfigError

__version__ = "0.1.0"

_LAZY = {
    "init": ("plait.distributed.context", "init"),
    "ParallelContext": ("plait.distributed.context", "ParallelContext"),
    "ParallelConfig": ("plait.parallel_config", "ParallelConfig"),
    "parallelize": ("plait.parallelization", "parallelize"),
    "ParallelModel": ("plait.parallel_model", "ParallelModel"),
    "generate": ("plait.generation", "generate"),
}
_SUBMODULES = {
    "models", "schedules", "sim", "plan", "distributed", "tensor_parallel", "pipeline",
    "data_parallel", "experts", "train", "generation", "optim",
}

__all__ = ["ConfigError", "CommError", "CommTimeoutError", "__version__", *_LAZY, *sorted(_SUBMODULES)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"plait.{name}")
    raise AttributeError(f"module 'plait' has no attribute {name!r}")
