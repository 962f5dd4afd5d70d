"""Test helpers: launch a Gloo world once and run many named checks inside it, with comparisons."""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch

from plait.distributed.launch import run_world


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (0 when both are zero)."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if actual.shape != expected.shape:
        return float("inf")
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    return diff / scale if scale > 0 else diff


def run_checks(checks: list[tuple[str, Callable[[], object]]]) -> dict[str, object]:
    """Run each check on this rank; a failing check records its traceback instead of stopping the rest."""
    results: dict[str, object] = {}
    for name, fn in checks:
        try:
            results[name] = fn()
        except Exception:  # recorded and asserted on by the test that owns the check
            results[name] = {"error": traceback.format_exc()}
    return results


def launch(entry: Callable[..., dict], nprocs: int, *args, timeout_s: float = 420.0) -> list[dict]:
    """Run ``entry(*args)`` on ``nprocs`` Gloo ranks; returns each rank's dict of check results."""
    return run_world(entry, nprocs, *args, timeout_s=timeout_s)


def result(world: list[dict], name: str) -> list[object]:
    """The per-rank results of one check; fails the test with the rank's traceback if it raised."""
    values = []
    for rank, res in enumerate(world):
        assert name in res, f"check {name!r} did not run on rank {rank}"
        value = res[name]
        if isinstance(value, dict) and "error" in value:
            raise AssertionError(f"check {name!r} raised on rank {rank}:\n{value['error']}")
        values.append(value)
    return values
