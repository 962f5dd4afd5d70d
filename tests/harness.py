"""Test helpers: launch a Gloo world once and run many named checks inside it, with comparisons."""

from __future__ import annotations

import traceback
from collections.abc import Callable

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


def run_checks(checks: list[tuple[str, Callable[[], object]]]) -> dict[str, object]:
    """Run each check on this rank; a failing check records its traceback instead of stopping the rest."""
    results: dict[str, object] = {}
    for name, fn in checks:
        try:
            results[name] = fn()
        except Exception:  # recorded and asserted on by the test that owns the check
            results[name] = {"error": traceback.format_exc()}
    return results


def run_groups(groups: dict[str, tuple[str, tuple]]) -> dict[str, dict]:
    """Rank side of a launch shared by several test modules: ``{group: (checks module, args)}``, each module's
    ``rank_main(*args)`` in turn, its results under the group's name. A group that raises outside its checks
    records ``{"error": traceback}`` and the next group still runs. Each group starts as in a launch of its own:
    the default dtype, and no process group (fresh_world)."""
    import importlib

    out: dict[str, dict] = {}
    dtype = torch.get_default_dtype()
    for group, (module, args) in groups.items():
        try:
            out[group] = importlib.import_module(module).rank_main(*args)
        except Exception:  # asserted on by the group's tests (group_result)
            out[group] = {"error": traceback.format_exc()}
        finally:
            torch.set_default_dtype(dtype)
        fresh_world()
    return out


def fresh_world() -> None:
    """Destroy every process group of this rank; the next ``plait.init`` starts the world again on a new port.
    Gloo keeps two or three threads per group, and the idle ones of hundreds of groups cost a core of two."""
    import os

    import torch.distributed as dist

    from plait.distributed.launch import free_port

    if not dist.is_initialized():
        return
    port = [free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])


def group_result(world: list[dict], group: str) -> list[dict]:
    """One group's per-rank results from a shared launch (run_groups); fails with the traceback if it raised."""
    rows = []
    for rank, res in enumerate(world):
        assert group in res, f"group {group!r} did not run on rank {rank}"
        value = res[group]
        if set(value) == {"error"} and isinstance(value["error"], str):
            raise AssertionError(f"group {group!r} raised on rank {rank}:\n{value['error']}")
        rows.append(value)
    return rows


def launch(entry: Callable[..., dict], nprocs: int, *args, timeout_s: float = 420.0,
           preload: tuple[str, ...] = ()) -> list[dict]:
    """Run ``entry(*args)`` on ``nprocs`` Gloo ranks; returns each rank's dict of check results. ``preload``:
    forked from run_world's fork server, which imported those modules once, instead of fresh interpreters."""
    return run_world(entry, nprocs, *args, timeout_s=timeout_s, preload=preload)


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
