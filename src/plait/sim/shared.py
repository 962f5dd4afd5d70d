"""Simulate a schedule on ranks that share CPU cores: processes on one host time-slice ``cores`` cores.

``plait.sim.simulate`` gives every rank its own device. When pipeline ranks are processes of one host
and outnumber its cores, a rank computes slower while more ranks compute at once: with ``k`` ranks
computing, each progresses at ``min(1, cores / k)`` of its own speed (processor sharing, as the kernel's
fair scheduler approximates), and ``handoff`` times slower still while ``k > cores`` (ranks that wake each
other on a full host take cores from running ones). Each action is its compute (``cpu`` seconds alone,
shared) followed by its communication (``comm`` seconds, not sharing a core); the dependencies are those
of ``plait.schedules.execute`` (a remote input arrives ``p2p`` after it was produced). Event-driven: every
event (an action's compute or communication ending, a delayed input arriving) is visited once.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import ConfigError
from plait.schedules import Schedule
from plait.schedules.execute import dependencies
from plait.sim.engine import bubble_fraction

_IDLE, _WAIT, _CPU, _COMM, _DONE = range(5)


@dataclass
class SharedResult:
    """Makespan, per-rank busy time (wall time inside actions, stretched by sharing) and the timeline."""

    makespan: float
    busy: list[float]
    timeline: list[tuple[int, object, float, float]]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the makespan, averaged over ranks (``plait.sim.engine.bubble_fraction``)."""
        return bubble_fraction(self.makespan, self.busy)


class _Rank:
    def __init__(self) -> None:
        self.i = 0
        self.state = _IDLE
        self.left = 0.0  # compute left (seconds alone) or the time communication / a wait ends
        self.start = 0.0
        self.busy = 0.0


def simulate_shared(schedule: Schedule, cpu: dict[str, list[float]], comm: dict[str, list[float]],
                    p2p: float, cores: float, handoff: float = 1.0) -> SharedResult:
    """``cpu[kind][chunk]`` / ``comm[kind][chunk]``: seconds of each kind of action on each chunk.
    ``handoff``: how many times slower than ``cores / k`` ranks run while they outnumber the cores (``k >
    cores``): ranks that hand work to each other wake one another, and a woken rank on a full host takes a
    core from one that was running (``plait calibrate`` times a pipeline of real layers against the same
    work without hand-offs; 1.08-1.11 for four processes on two cores)."""
    if cores <= 0:
        raise ConfigError(f"cores={cores}: must be > 0")
    if handoff < 1.0:
        raise ConfigError(f"handoff={handoff}: must be >= 1 (a slow-down)")
    n, m = schedule.num_stages, schedule.microbatches
    done: tuple[dict, dict] = ({}, {})  # (table, key) -> end time, for forward (0) and backward (1) results
    ranks = [_Rank() for _ in schedule.actions]
    timeline: list[tuple[int, object, float, float]] = []
    now = 0.0
    for r, rk in enumerate(ranks):
        _try_start(schedule, r, rk, done, now, p2p, n, m)
        _advance(schedule, r, rk, cpu, comm, done, now, p2p, n, m, timeline)
    while any(rk.state != _DONE for rk in ranks):
        computing = [rk for rk in ranks if rk.state == _CPU]
        k = len(computing)
        speed = 1.0 if k <= cores else cores / (k * handoff)
        times = [rk.left / speed for rk in computing]
        times += [rk.left - now for rk in ranks if rk.state in (_COMM, _WAIT)]
        if not times:
            stuck = [r for r, rk in enumerate(ranks) if rk.state == _IDLE]
            raise ConfigError(f"schedule {schedule.name}: ranks {stuck} wait forever (it deadlocks)")
        dt = max(min(times), 0.0)
        now += dt
        for rk in computing:
            rk.left -= dt * speed
        changed = True
        while changed:  # an action that ends may let others start (at once, if their inputs are local)
            before = [(rk.i, rk.state) for rk in ranks]
            for r, rk in enumerate(ranks):
                if rk.state == _IDLE:
                    _try_start(schedule, r, rk, done, now, p2p, n, m)
                _advance(schedule, r, rk, cpu, comm, done, now, p2p, n, m, timeline)
            changed = before != [(rk.i, rk.state) for rk in ranks]
    return SharedResult(now, [rk.busy for rk in ranks], timeline)


def _advance(schedule, r, rk, cpu, comm, done, now, p2p, n, m, timeline) -> None:
    """Move ``rk`` past every phase that ended by ``now``."""
    eps = 1e-15 * max(now, 1.0)
    while True:
        if rk.state == _WAIT and rk.left <= now + eps:
            kind, c, _ = schedule.actions[r][rk.i]
            rk.state, rk.start, rk.left = _CPU, now, cpu[kind][c]
        elif rk.state == _CPU and rk.left <= eps:
            kind, c, _ = schedule.actions[r][rk.i]
            rk.state, rk.left = _COMM, now + comm[kind][c]
        elif rk.state == _COMM and rk.left <= now + eps:
            act = schedule.actions[r][rk.i]
            kind, c, mb = act
            timeline.append((r, act, rk.start, now))
            rk.busy += now - rk.start
            if kind != "W":
                done[0 if kind == "F" else 1][c * m + mb] = now
            rk.i += 1
            rk.state = _IDLE
            _try_start(schedule, r, rk, done, now, p2p, n, m)
            if rk.state == _IDLE:
                return
        else:
            return


def _try_start(schedule, r, rk, done, now, p2p, n, m) -> None:
    """If every input of the rank's next action exists, wait for the last to arrive; else stay idle."""
    if rk.i >= len(schedule.actions[r]):
        rk.state = _DONE
        return
    kind, c, mb = schedule.actions[r][rk.i]
    begin = now
    for table, key, chunk in dependencies(kind, c, mb, n - 1, m):
        end = done[table].get(key)
        if end is None:
            return
        if schedule.placement[chunk] != r:
            end += p2p
        begin = max(begin, end)
    rk.state, rk.left = _WAIT, begin
