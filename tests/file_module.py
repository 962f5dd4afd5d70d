"""A module of the repository that is no package's (bench/'s scripts, .ci/'s checkers), loaded from its file."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load(relative: str, name: str) -> ModuleType:
    """The module in ``ROOT / relative``, executed once under ``name`` (not put in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    assert spec is not None and spec.loader is not None, relative
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
