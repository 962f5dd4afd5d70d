"""The direction of dependencies between plait's packages (docs/architecture.md), read from the sources.

Every ``import`` statement counts, at any depth (inside functions, under ``TYPE_CHECKING``): a lazy import
is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (relative imports resolved; ``from a import b`` counts ``a`` and ``a.b``)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    """module -> the modules it imports, for every module of plait."""
    return {_module_name(p): _imports(p) for p in sorted((SRC / "plait").rglob("*.py"))}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def offenders(graph: dict[str, set[str]], packages: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    """``module -> import`` for every import from ``packages`` into ``forbidden``."""
    return sorted(f"{m} -> {i}" for m, imported in graph.items() if any(_within(m, p) for p in packages)
                  for i in imported if any(_within(i, f) for f in forbidden))


# (who, what they must not import, why)
RULES = [
    (("plait.train",), ("plait.plan", "plait.calibrate"),
     "the trainer measures; the CLI installs the planner's prediction (plait.train.observe)"),
    (("plait.generation", "plait.serve", "plait.checkpoint", "plait.tokenizers"), ("plait.train",),
     "generation and serving share checkpoints and tokenizers with training, not the trainer"),
]


@pytest.mark.parametrize(("packages", "forbidden", "why"), RULES, ids=[" ".join(r[0]) for r in RULES])
def test_dependency_rule(packages, forbidden, why):
    assert offenders(graph(), packages, forbidden) == [], why


def test_the_scan_sees_real_imports():  # not vacuous: lazy, relative and TYPE_CHECKING imports are all seen
    g = graph()
    assert "plait.models" in g["plait.train.loop"] or "plait.models.hf" in g["plait.train.loop"]
    assert "plait.train.observe.Prediction" in g["plait.train.loop"]  # under TYPE_CHECKING
    assert offenders(g, ("plait.cli",), ("plait.plan",))  # the CLI does use the planner
    assert offenders({"plait.train.x": {"plait.plan.search"}}, ("plait.train",), ("plait.plan",))
