"""bench/ for users: run_all.py runs scripts that exist, every benchmark is run or said why not, and
bench/README.md's table names every one."""

from __future__ import annotations

from pathlib import Path

from file_module import load

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _run_all():
    return load("bench/run_all.py", "bench_run_all")


def test_run_all_lists_existing_scripts_and_says_why_it_leaves_any_out():
    run_all = _run_all()
    listed = [name for name, _ in run_all.ORDER]
    assert all((BENCH / name).is_file() for name in listed), [n for n in listed if not (BENCH / n).is_file()]
    assert all((BENCH / name).is_file() for name in run_all.LEFT_OUT)
    scripts = {p.name for p in BENCH.glob("*.py")}
    assert scripts == set(listed) | set(run_all.LEFT_OUT), scripts ^ (set(listed) | set(run_all.LEFT_OUT))


def test_the_readme_table_names_every_benchmark():
    text = (BENCH / "README.md").read_text()
    missing = [p.name for p in BENCH.glob("*.py") if p.name != "run_all.py" and f"`{p.name}" not in text]
    missing += [f"planner/{p.name}" for p in (BENCH / "planner").glob("*.py") if p.name not in text]
    assert not missing, missing
