"""One launch of N Gloo ranks shared by several test modules (conftest's world of 4), each module's checks a group
with a time bound of its own.

Each rank notes in a file of its own when each group and each check begins and ends (``harness.note``), and saves
each check's result and each group's as it ends. A group that runs past its bound stops its rank (a watchdog
thread); the launch then ends, the groups that ended keep their results, the group that ran long is reported with
the check each rank was in and for how long, and the groups after it run in a new launch. So a slow group fails
its own tests, naming itself, and no other's.
"""

from __future__ import annotations

import importlib
import os
import pickle
import threading
import time
import traceback
from pathlib import Path

import torch

from harness import CHECKS_ENV, note, notes, saved_checks
from plait.distributed.launch import LaunchError, run_world

OVERRAN_EXIT = 75  # the exit status of a rank its watchdog stopped
START_S = 120.0  # what a launch may take beyond its groups' bounds: starting the ranks, collecting the results


class Stopped(dict):
    """The results a group's rank saved before its launch was stopped (``reason``); reading a check it did not
    reach fails with the reason."""

    def __init__(self, values: dict, reason: str):
        super().__init__(values)
        self.reason = reason

    def __missing__(self, key):
        raise AssertionError(f"{key!r} was not reached: {self.reason}")


def run_groups(groups: dict[str, tuple[str, tuple]], folder: str, bounds: dict[str, float]) -> dict[str, dict]:
    """Rank side: ``{group: (checks module, args)}``, each module's ``rank_main(*args)`` in turn, its results under
    the group's name and saved in ``folder``. A group that raises outside its checks records
    ``{"error": traceback}`` and the next group still runs; one that runs past ``bounds[group]`` seconds ends this
    process (``OVERRAN_EXIT``). Each group starts as in a launch of its own: the default dtype, and no process
    group (fresh_world)."""
    rank = int(os.environ["RANK"])
    log = Path(folder, f"rank{rank}.log")
    out: dict[str, dict] = {}
    dtype = torch.get_default_dtype()
    for group, (module, args) in groups.items():
        os.environ[CHECKS_ENV] = str(Path(folder, f"rank{rank}.{group}"))
        note(log, "group", group)
        watchdog = threading.Timer(bounds[group], _overran, (log, group))
        watchdog.daemon = True
        watchdog.start()
        try:
            out[group] = importlib.import_module(module).rank_main(*args)
        except Exception:  # asserted on by the group's tests (group_result)
            out[group] = {"error": traceback.format_exc()}
        finally:
            torch.set_default_dtype(dtype)
        fresh_world()  # within the bound: its barrier waits for every rank to end the group
        watchdog.cancel()
        saved = Path(folder, f"rank{rank}.{group}.result")
        Path(f"{saved}.tmp").write_bytes(pickle.dumps(out[group]))
        os.replace(f"{saved}.tmp", saved)  # whole or absent: the watchdog may end this process at any line
        note(log, "ended", group)
    os.environ.pop(CHECKS_ENV, None)
    return out


def _overran(log: Path, group: str) -> None:
    note(log, "overran", group)
    os._exit(OVERRAN_EXIT)  # the main thread may be inside a collective that never returns


def fresh_world() -> None:
    """Destroy every process group of this rank; the next ``plait.init`` starts the world again on a new port.
    Gloo keeps two or three threads per group, and the idle ones of hundreds of groups cost a core of two."""
    import torch.distributed as dist

    from plait.distributed.launch import free_port

    if not dist.is_initialized():
        return
    port = [free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])


def launch_groups(groups: dict[str, tuple[str, tuple]], nprocs: int, bounds: dict[str, float], folder: str,
                  preload: tuple[str, ...] = ()) -> list[dict]:
    """Run ``groups`` (run_groups) on ``nprocs`` ranks; each rank's ``{group: results}``. When a launch ends
    early (a group ran past its bound, a rank died), the groups that ended keep their results, the one under way
    gets a ``Stopped`` of the checks it finished and an error naming what ran long, and the rest run again in a
    new launch."""
    merged: list[dict] = [{} for _ in range(nprocs)]
    todo = dict(groups)
    while todo:
        try:
            values = run_world(run_groups, nprocs, todo, folder, bounds, preload=preload,
                               timeout_s=sum(bounds[g] for g in todo) + START_S)
        except LaunchError as exc:
            done = [g for g in todo if all(Path(folder, f"rank{r}.{g}.result").is_file() for r in range(nprocs))]
            for g in done:
                for r in range(nprocs):
                    merged[r][g] = pickle.loads(Path(folder, f"rank{r}.{g}.result").read_bytes())
            stuck = next((g for g in todo if g not in done), None)
            if stuck is None:  # every group ended: the launch failed as it returned
                raise
            reason = stop_reason(folder, stuck, nprocs, bounds[stuck], exc)
            for r in range(nprocs):
                checks = saved_checks(str(Path(folder, f"rank{r}.{stuck}")))
                merged[r][stuck] = Stopped({**checks, **{name: {"error": reason} for name in started(folder, r, stuck)
                                                         if name not in checks}}, reason)
            todo = {g: v for g, v in todo.items() if g not in done and g != stuck}
            continue
        for r, value in enumerate(values):
            merged[r].update(value)
        todo = {}
    return merged


def _group_lines(folder: str, rank: int, group: str) -> list[tuple[float, str, str]]:
    """The rank's notes of ``group`` (its start first, then its checks'), or [] if it never began. A group runs
    at most once (launch_groups runs only the groups that did not begin)."""
    own = [line for line in notes(Path(folder, f"rank{rank}.log")) if line[2] == group]
    return sorted(own + notes(Path(folder, f"rank{rank}.{group}.log"))) if own else []


def started(folder: str, rank: int, group: str) -> list[str]:
    """The checks of ``group`` this rank began and did not end."""
    lines = _group_lines(folder, rank, group)
    begun = [name for _t, kind, name in lines if kind == "check"]
    ended = {name for _t, kind, name in lines if kind == "done"}
    return [name for name in begun if name not in ended]


def stop_reason(folder: str, group: str, nprocs: int, bound: float, exc: LaunchError) -> str:
    """What each rank was doing in ``group`` when its launch ended: the check under way and for how long."""
    parts = []
    now = time.monotonic()
    for r in range(nprocs):
        lines = _group_lines(folder, r, group)
        if not lines:
            parts.append(f"rank {r}: never began it")
            continue
        began = lines[0][0]
        end = next((t for t, kind, _n in lines if kind == "overran"), None)
        how = f"ran past its bound of {bound:.0f} s" if end is not None else "was stopped"
        open_checks = started(folder, r, group)
        last = max((t for t, kind, name in lines if kind == "check" and name in open_checks), default=None)
        where = (f"in check {open_checks[-1]!r}, begun {last - began:.0f} s into the group" if last is not None
                 else "outside its checks")
        parts.append(f"rank {r}: {how} {where} ({(end or now) - began:.0f} s in the group)")
    return (f"group {group!r} did not end (bound {bound:.0f} s); the groups after it ran in a new launch. "
            f"{'; '.join(parts)}. The launch: {exc}")


def group_result(world: list[dict], group: str) -> list[dict]:
    """One group's per-rank results from a shared launch (run_groups); fails with the traceback if it raised."""
    rows = []
    for rank, res in enumerate(world):
        assert group in res, f"group {group!r} did not run on rank {rank}"
        value = res[group]
        if not isinstance(value, Stopped) and set(value) == {"error"} and isinstance(value["error"], str):
            raise AssertionError(f"group {group!r} raised on rank {rank}:\n{value['error']}")
        rows.append(value)
    return rows
