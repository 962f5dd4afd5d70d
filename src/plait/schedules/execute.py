"""In-order execution of a schedule: the dry run behind ``validate()`` and the timing core of ``plait.sim``.

Every rank runs its actions in list order, one at a time. An action starts when its rank is free and
every action it depends on has finished (plus ``p2p`` when that action ran on another rank):

* ``F(c, mb)`` needs ``F(c-1, mb)`` (the activation from the previous chunk);
* ``B(c, mb)`` / ``I(c, mb)`` need ``F(c, mb)`` (its saved activations) and the backward
  (``B`` or ``I``) of ``(c+1, mb)`` (the gradient from the next chunk); the last chunk's backward
  starts from the loss, so it only needs its own forward;
* ``W(c, mb)`` needs ``I(c, mb)``.

Sends are asynchronous and unbounded, so only receives block. Because nothing but a rank's own order
and these dependencies constrains a start time, the result is a longest-path computation on a DAG:
ranks are advanced by a cursor walk in any order that respects dependencies, each action is visited
once and the cost is linear in the number of actions. A rank that ends before its list does is
deadlocked.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plait.schedules.actions import Action

if TYPE_CHECKING:
    from plait.schedules.schedule import Schedule

_NOT_DONE = -1.0


@dataclass
class Execution:
    """Start/end times per rank (aligned with ``schedule.actions[rank]``) and where ranks got stuck."""

    starts: list[list[float]]
    ends: list[list[float]]
    #: rank -> (index of the action it is blocked at, the action it waits for)
    stuck: dict[int, tuple[int, Action]] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return not self.stuck


def dependencies(kind: str, c: int, mb: int, last: int, m: int) -> list[tuple[int, int, int]]:
    """(table, key, producing chunk) of each dependency; table 0 = forward ends, 1 = backward ends."""
    if kind == "F":
        return [(0, (c - 1) * m + mb, c - 1)] if c > 0 else []
    if kind == "W":
        return [(1, c * m + mb, c)]
    deps = [(0, c * m + mb, c)]
    if c < last:
        deps.append((1, (c + 1) * m + mb, c + 1))
    return deps


def execute(
    schedule: Schedule,
    durations: dict[str, list[float]] | None = None,
    p2p: float = 0.0,
) -> Execution:
    """Run ``schedule`` in order with ``durations[kind][chunk]`` (1.0 each when None).

    Assumes the structure was checked (each action once, on its owning rank); see ``validate``.
    """
    num_chunks, m = schedule.num_stages, schedule.microbatches
    placement = schedule.placement
    if durations is None:
        durations = {k: [1.0] * num_chunks for k in "FBIW"}
    tables = ([_NOT_DONE] * (num_chunks * m), [_NOT_DONE] * (num_chunks * m))
    starts: list[list[float]] = [[] for _ in schedule.actions]
    ends: list[list[float]] = [[] for _ in schedule.actions]
    waiting: dict[tuple[int, int], list[int]] = {}
    blocked: dict[int, tuple[int, tuple[int, int, int]]] = {}
    free = [0.0] * schedule.num_ranks
    ready = deque(range(schedule.num_ranks))
    last = num_chunks - 1
    while ready:
        r = ready.popleft()
        blocked.pop(r, None)
        lst, st, en = schedule.actions[r], starts[r], ends[r]
        t = free[r]
        i = len(st)
        while i < len(lst):
            kind, c, mb = lst[i]
            begin = t
            miss = None
            for dep in dependencies(kind, c, mb, last, m):
                done = tables[dep[0]][dep[1]]
                if done < 0.0:
                    miss = dep
                    break
                if placement[dep[2]] != r:
                    done += p2p
                if done > begin:
                    begin = done
            if miss is not None:
                waiting.setdefault(miss[:2], []).append(r)
                blocked[r] = (i, miss)
                break
            t = begin + durations[kind][c]
            st.append(begin)
            en.append(t)
            key = (0, c * m + mb) if kind == "F" else (1, c * m + mb)
            if kind != "W":
                tables[key[0]][key[1]] = t
                woken = waiting.pop(key, None)
                if woken:
                    ready.extend(woken)
            i += 1
        free[r] = t
    stuck = {r: (i, _dep_action(schedule, dep)) for r, (i, dep) in blocked.items()}
    return Execution(starts, ends, stuck)


def _dep_action(schedule: Schedule, dep: tuple[int, int, int]) -> Action:
    """The action that would have produced a missing dependency (B or I, whichever the schedule has)."""
    table, key, chunk = dep
    mb = key % schedule.microbatches
    if table == 0:
        return Action("F", chunk, mb)
    for act in schedule.actions[schedule.placement[chunk]]:
        if act.stage == chunk and act.microbatch == mb and act.kind in "BI":
            return act
    return Action("B", chunk, mb)
