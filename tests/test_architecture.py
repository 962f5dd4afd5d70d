"""The direction of dependencies between plait's packages (docs/architecture.md), and what one module may use of
another (its public names), read from the sources.

Every ``import`` statement counts, at any depth (inside functions, under ``TYPE_CHECKING``): a lazy import
is still a dependency.
"""

from __future__ import annotations

import ast
import functools
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


@functools.cache
def graph() -> dict[str, set[str]]:
    """module -> the modules it imports, for every module of plait."""
    return {_module_name(p): _imports(p) for p in sorted((SRC / "plait").rglob("*.py"))}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def offenders(graph: dict[str, set[str]], packages: tuple[str, ...], forbidden: tuple[str, ...],
              allowed: tuple[str, ...] = ()) -> list[str]:
    """``module -> import`` for every import from ``packages`` into ``forbidden`` (``allowed`` excepted)."""
    return sorted(f"{m} -> {i}" for m, imported in graph.items() if any(_within(m, p) for p in packages)
                  for i in imported if any(_within(i, f) for f in forbidden)
                  and not any(_within(i, a) for a in allowed))


# the runtime: what applies and runs a layout
RUNTIME = ("plait.distributed", "plait.tensor_parallel", "plait.pipeline", "plait.data_parallel", "plait.experts",
           "plait.context_parallel", "plait.parallelization", "plait.parallel_model", "plait.optim",
           "plait.weight_grad", "plait.recompute", "plait.devices")
# what is built on the runtime
APPS = ("plait.train", "plait.generation", "plait.serve", "plait.cli", "plait.data", "plait.checkpoint")
# the cost formulas of a layer (torch-free) that the planner, the runtime's balanced partition and the model
# adapters share: one partition function for planner and runtime
BALANCE = ("plait.pipeline.balance",)
MODEL_DEFINITIONS = tuple(f"plait.models.{m}" for m in ("llama", "mistral", "mixtral", "qwen2", "qwen3", "moe",
                                                         "init", "hf"))
LIBRARY = tuple(sorted({".".join(m.split(".")[:2]) for m in graph()} - {"plait", "plait.cli"}))

# (who, what they must not import, except, why)
RULES = [
    (("plait.schedules", "plait.sim", "plait.plan", "plait.parallel_config"), ("torch", "numpy"), (),
     "the planner and simulator start instantly and run anywhere"),
    (("plait.schedules",), ("plait.sim", "plait.plan") + RUNTIME + APPS, (), "a schedule is data"),
    (("plait.sim",), ("plait.plan",) + RUNTIME + APPS, (), "the simulator runs schedules, nothing else"),
    (("plait.plan",), RUNTIME + ("plait.models", "plait.calibrate", "plait.generation", "plait.serve",
                                 "plait.cli", "plait.checkpoint", "plait.data", "plait.train"), BALANCE,
     "the planner is pure: it reads a measured host's profile, it does not measure"),
    (MODEL_DEFINITIONS, RUNTIME + APPS + ("plait.plan", "plait.calibrate", "plait.parallel_config"), (),
     "model definitions know nothing of parallelism: a layout is applied from outside"),
    (("plait.models",), RUNTIME + APPS + ("plait.plan", "plait.calibrate"), BALANCE,
     "the family adapters describe a model to the runtime; they do not call it"),
    (RUNTIME, APPS + ("plait.plan", "plait.calibrate"), (), "the runtime is a library under the applications"),
    (("plait.train",), ("plait.plan", "plait.calibrate"), (),
     "the trainer measures; the CLI installs the planner's prediction (plait.train.observe)"),
    (("plait.generation", "plait.serve", "plait.checkpoint", "plait.tokenizers"), ("plait.train",), (),
     "generation and serving share checkpoints and tokenizers with training, not the trainer"),
    (("plait.data",), ("plait.serve", "plait.generation", "plait.train"), (),
     "data preparation renders chats with the shared chat template (plait.chat_template), not the server's"),
    (LIBRARY, ("plait.cli",), (), "the command line is thin and on top: nothing of the library imports it"),
]


@pytest.mark.parametrize(("packages", "forbidden", "allowed", "why"), RULES, ids=[" ".join(r[0]) for r in RULES])
def test_dependency_rule(packages, forbidden, allowed, why):
    assert offenders(graph(), packages, forbidden, allowed) == [], why


def test_the_scan_sees_real_imports():  # not vacuous: lazy, relative and TYPE_CHECKING imports are all seen
    g = graph()
    assert "plait.models" in g["plait.train.loop"] or "plait.models.hf" in g["plait.train.loop"]
    assert "plait.train.observe.Prediction" in g["plait.train.loop"]  # under TYPE_CHECKING
    assert offenders(g, ("plait.cli",), ("plait.plan",))  # the CLI does use the planner
    assert offenders({"plait.train.x": {"plait.plan.search"}}, ("plait.train",), ("plait.plan",))


@functools.cache
def _sources() -> dict[str, ast.Module]:
    """module -> its syntax tree, for every module of plait (parsed once for the tests below)."""
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted((SRC / "plait").rglob("*.py"))}


def private_imports(sources: dict[str, ast.Module]) -> list[str]:
    """``module -> name`` for every ``from plait.x import _name`` of a module that is not ``plait.x`` itself."""
    return sorted(f"{m} -> {node.module}.{alias.name}" for m, tree in sources.items() for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plait")
                  and node.module != m for alias in node.names
                  if alias.name.startswith("_") and not alias.name.startswith("__"))


def mark_users(sources: dict[str, ast.Module]) -> dict[str, list[str]]:
    """The attribute names plait sets on torch's objects (``"_plait_..."`` strings), each with the modules that spell
    it. One module owns a mark and gives the others functions to set and read it."""
    found: dict[str, set[str]] = {}
    for m, tree in sources.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_plait_"):
                found.setdefault(node.value, set()).add(m)
    return {mark: sorted(modules) for mark, modules in found.items()}


def test_no_module_imports_another_modules_private_names():
    assert private_imports(_sources()) == []


def test_each_mark_plait_puts_on_a_tensor_is_spelt_in_one_module():
    marks = mark_users(_sources())
    assert {"_plait_grad_group", "_plait_grad_sink", "_plait_tp_partial"} <= set(marks)  # the scan sees them
    assert {mark: modules for mark, modules in marks.items() if len(modules) > 1} == {}


def test_the_private_name_scans_see_offenders():  # not vacuous
    tree = ast.parse("from plait.a import _b, c\nfrom plait.d import _e\ngetattr(p, '_plait_x')")
    assert private_imports({"plait.d": tree}) == ["plait.d -> plait.a._b"]
    assert mark_users({"plait.d": tree, "plait.f": ast.parse("setattr(p, '_plait_x', 1)")}) == {
        "_plait_x": ["plait.d", "plait.f"]}


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _defined(sources: dict[str, ast.Module], module: str, name: str,
             hops: int = 2) -> tuple[str, ast.FunctionDef] | None:
    """The module-level function ``module.name`` (through a package's re-export), or None."""
    for node in sources[module].body if module in sources else ():
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return module, node
        if hops and isinstance(node, ast.ImportFrom) and node.module in sources and not node.level \
                and any(alias.name == name and alias.asname is None for alias in node.names):
            return _defined(sources, node.module, name, hops - 1)
    return None


def untyped_seams(sources: dict[str, ast.Module]) -> list[str]:
    """``module.function`` for every module-level function that another package imports and whose parameters or
    return are not all annotated."""
    found = set()
    for m, tree in sources.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plait.")):
                continue
            for alias in node.names:
                hit = _defined(sources, node.module, alias.name)
                if hit is None or _package(hit[0]) == _package(m):
                    continue
                fn = hit[1]
                args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs, fn.args.vararg, fn.args.kwarg]
                if fn.returns is None or any(a is not None and a.annotation is None for a in args):
                    found.add(f"{hit[0]}.{fn.name}")
    return sorted(found)


def test_the_functions_one_package_calls_of_another_are_annotated():
    assert untyped_seams(_sources()) == []


def test_the_seam_scan_sees_an_unannotated_function():  # not vacuous: direct and re-exported imports are seen
    sources = {"plait.a.f": ast.parse("def f(x) -> int: ...\ndef g(x: int) -> int: ...\ndef h(x: int): ..."),
               "plait.a": ast.parse("from plait.a.f import h"),
               "plait.b": ast.parse("from plait.a.f import f, g\nfrom plait.a import h")}
    assert untyped_seams(sources) == ["plait.a.f.f", "plait.a.f.h"]
