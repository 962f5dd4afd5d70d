"""Test helpers: launch a Gloo world once and run many named checks inside it, with comparisons."""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from plait.distributed.launch import run_world

#: the modules a launch whose start-up is not under test preloads (run_world's ``preload``): its ranks are forked
#: from one server that imported torch once instead of fresh interpreters each importing it; on 2 cores a world
#: of 4 with little to run started in 4 s instead of 9. torch._dynamo: every torch optimizer imports it when it
#: is made (~2 s of CPU a rank otherwise)
PRELOAD = ("torch", "torch._dynamo")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 when both are zero)."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if actual.shape != expected.shape:
        return float("inf")
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale > 0 else diff


#: where run_checks keeps account when the environment names it (shared_world.run_groups does, per group): each
#: check's start and end noted in ``$HARNESS_CHECKS.log``, its result appended to ``$HARNESS_CHECKS.pkl``
CHECKS_ENV = "HARNESS_CHECKS"


def run_checks(checks: list[tuple[str, Callable[[], object]]]) -> dict[str, object]:
    """Run each check on this rank; a failing check records its traceback instead of stopping the rest."""
    results: dict[str, object] = {}
    base = os.environ.get(CHECKS_ENV)
    for name, fn in checks:
        if base:
            note(Path(base + ".log"), "check", name)
        try:
            results[name] = fn()
        except Exception:  # recorded and asserted on by the test that owns the check
            results[name] = {"error": traceback.format_exc()}
        if base:
            with open(base + ".pkl", "ab") as f:
                pickle.dump((name, results[name]), f)
            note(Path(base + ".log"), "done", name)
    return results


def note(path: Path, kind: str, name: str) -> None:
    """Append ``(now, kind, name)`` to the notes at ``path`` (read by ``notes``; ``now``: time.monotonic(), one
    clock for every process of the host)."""
    with open(path, "a") as f:
        f.write(f"{time.monotonic():.3f}\t{kind}\t{name}\n")


def notes(path: Path) -> list[tuple[float, str, str]]:
    """The notes at ``path``, in order; [] if there are none."""
    if not path.is_file():
        return []
    rows = [line.split("\t", 2) for line in path.read_text().splitlines()]
    return [(float(t), kind, name) for t, kind, name in rows]


def saved_checks(base: str) -> dict[str, object]:
    """The results run_checks appended to ``base + ".pkl"``, by check name."""
    out: dict[str, object] = {}
    path = Path(base + ".pkl")
    if path.is_file():
        with open(path, "rb") as f:
            while True:
                try:
                    name, value = pickle.load(f)
                except (EOFError, pickle.UnpicklingError):  # the end, or a record cut short by the rank's end
                    return out
                out[name] = value
    return out


def launch(entry: Callable[..., dict], nprocs: int, *args, timeout_s: float = 420.0,
           preload: tuple[str, ...] = ()) -> list[dict]:
    """Run ``entry(*args)`` on ``nprocs`` Gloo ranks; returns each rank's dict of check results. ``preload``:
    forked from run_world's fork server, which imported those modules once, instead of fresh interpreters."""
    return run_world(entry, nprocs, *args, timeout_s=timeout_s, preload=preload)


def result(world: list[dict], name: str) -> list[object]:
    """The per-rank results of one check; fails the test with the rank's traceback if it raised."""
    values = []
    for rank, res in enumerate(world):
        assert name in res, f"check {name!r} did not run on rank {rank}" + (
            f": {res.reason}" if hasattr(res, "reason") else "")  # shared_world.Stopped: its launch was stopped
        value = res[name]
        if isinstance(value, dict) and "error" in value:
            raise AssertionError(f"check {name!r} raised on rank {rank}:\n{value['error']}")
        values.append(value)
    return values


def alive(pid: int | str) -> bool:
    """``pid`` exists and has not ended (a zombie, ended but not yet reaped, has): Linux's /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
