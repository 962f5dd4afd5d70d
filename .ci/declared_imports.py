"""List plait's third-party imports that its declared requirements do not cover; exit 1 if there is any.

An import counts as declared when its distribution is a base requirement, or an extra's requirement and the
importing file belongs to that extra's feature (``EXTRA_MODULES``). A package that only arrives as a
dependency of a dependency is NOT declared: it may vanish with the next release of that dependency.

    python .ci/declared_imports.py --pyproject pyproject.toml --src src/plait   # the source tree
    python .ci/declared_imports.py --installed                                  # the installed wheel
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from importlib import metadata
from pathlib import Path

#: files (by path prefix inside the package) that may import an extra's packages, and which extra
EXTRA_MODULES = {"data": ("plait/data/sources.py",), "wandb": ("plait/train/logs.py",)}
#: import name -> distribution name, for what is not installed where the check runs
DIST_OF = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn"}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def third_party_imports(package_dir: Path) -> dict[str, set[str]]:
    """Top-level third-party module -> files importing it (``plait/...`` paths; lazy imports included)."""
    std = set(sys.stdlib_module_names) | {"plait", "__future__"}
    found: dict[str, set[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - std:
                found.setdefault(top, set()).add(path.relative_to(package_dir.parent).as_posix())
    return found


def _split(requirements: list[str]) -> tuple[set[str], dict[str, set[str]]]:
    """(base distributions, extra -> distributions) from requirement strings such as ``x>=1; extra == "y"``."""
    base: set[str] = set()
    extras: dict[str, set[str]] = {}
    for req in requirements:
        name = normalise(re.split(r"[<>=!~;\[ (]", req, maxsplit=1)[0])
        extra = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", req)
        (extras.setdefault(extra.group(1), set()) if extra else base).add(name)
    return base, extras


def from_pyproject(path: Path) -> tuple[set[str], dict[str, set[str]]]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads(path.read_text())["project"]
    base, _ = _split(project.get("dependencies", []))
    extras = {k: _split(v)[0] for k, v in project.get("optional-dependencies", {}).items()}
    return base, extras


def from_installed(dist: str = "plait") -> tuple[set[str], dict[str, set[str]]]:
    return _split(metadata.requires(dist) or [])


def undeclared(imports: dict[str, set[str]], base: set[str], extras: dict[str, set[str]]) -> list[str]:
    installed = metadata.packages_distributions()
    problems = []
    for module, files in sorted(imports.items()):
        dists = {normalise(d) for d in installed.get(module, [])} or {normalise(DIST_OF.get(module, module))}
        if dists & base:
            continue
        for file in sorted(files):
            owners = [x for x, prefixes in EXTRA_MODULES.items() if file.startswith(prefixes)]
            if not any(dists & extras.get(x, set()) for x in owners):
                where = f"the [{'/'.join(owners)}] extra" if owners else "the base dependencies"
                problems.append(f"{file} imports {module!r} ({', '.join(sorted(dists))}), not declared in {where}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, help="read requirements from this pyproject.toml")
    parser.add_argument("--src", type=Path, help="the plait package folder (default: the imported one)")
    parser.add_argument("--installed", action="store_true", help="read requirements of the installed plait")
    args = parser.parse_args(argv)
    if args.src is None:
        import plait

        args.src = Path(plait.__file__).parent
    base, extras = from_installed() if args.installed else from_pyproject(args.pyproject)
    problems = undeclared(third_party_imports(args.src), base, extras)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
