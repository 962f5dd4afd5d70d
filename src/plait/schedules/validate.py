"""Schedule validation: structural checks, a deadlock-detecting dry run, and the per-rank error grid."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.errors import ConfigError
from plait.schedules.actions import KINDS, Action
from plait.schedules.execute import Execution, execute

if TYPE_CHECKING:
    from plait.schedules.schedule import Schedule

_WINDOW = 24  # actions shown per rank row around the marked one


def validate(schedule: Schedule) -> None:
    """Raise ConfigError if ``schedule`` is malformed or deadlocks; see ``Schedule.validate``."""
    check_structure(schedule)
    run = execute(schedule)
    if not run.finished:
        raise deadlock_error(schedule, run)


def _fail(schedule: Schedule, what: str, marks: dict[int, int]) -> ConfigError:
    return ConfigError(f"invalid schedule {schedule.name!r}: {what}\n{format_grid(schedule, marks)}")


def _check_header(schedule: Schedule) -> None:
    p, v = schedule.num_ranks, schedule.virtual
    if len(schedule.actions) != p:
        raise ConfigError(f"schedule has {len(schedule.actions)} action rows but num_ranks={p}")
    if schedule.num_stages != p * v:
        raise ConfigError(f"placement has {schedule.num_stages} chunks; expected num_ranks*virtual={p * v}")
    if any(not 0 <= r < p for r in schedule.placement):
        raise ConfigError(f"placement {list(schedule.placement)} names a rank outside [0, {p})")
    if schedule.microbatches < 1:
        raise ConfigError(f"microbatches={schedule.microbatches}: must be >= 1")


def check_structure(schedule: Schedule) -> None:
    """Each (chunk, mb) has one F and one B, or one I and one W, all on the rank owning the chunk."""
    _check_header(schedule)
    n, m = schedule.num_stages, schedule.microbatches
    seen: dict[str, list[int]] = {k: [-1] * (n * m) for k in KINDS}  # key -> rank*2**32 + index
    for r, row in enumerate(schedule.actions):
        for i, act in enumerate(row):
            kind, c, mb = act
            if kind not in KINDS or not 0 <= c < n or not 0 <= mb < m:
                what = f"rank {r} step {i}: {act!r} out of range (chunks 0..{n - 1}, mbs 0..{m - 1})"
                raise _fail(schedule, what, {r: i})
            if schedule.placement[c] != r:
                what = f"rank {r} step {i}: {act} is chunk {c}, which lives on rank {schedule.placement[c]}"
                raise _fail(schedule, what, {r: i})
            key = c * m + mb
            if seen[kind][key] >= 0:
                what = f"rank {r} step {i}: {act} appears twice (each action must run exactly once)"
                raise _fail(schedule, what, {r: i})
            seen[kind][key] = (r << 32) + i
    _check_counts(schedule, seen)


def _check_counts(schedule: Schedule, seen: dict[str, list[int]]) -> None:
    m = schedule.microbatches

    def where(pos: int) -> dict[int, int]:
        return {pos >> 32: pos & 0xFFFFFFFF}

    for key in range(schedule.num_stages * m):
        c, mb = divmod(key, m)
        f, b, i, w = (seen[k][key] for k in KINDS)
        owner = schedule.placement[c]
        if f < 0:
            mark = where(max(b, i, w)) if max(b, i, w) >= 0 else {}
            raise _fail(schedule, f"no forward {c}F{mb} (expected on rank {owner})", mark)
        if b < 0 and i < 0:
            what = f"no backward for chunk {c} micro-batch {mb}: expected {c}B{mb}, or {c}I{mb} then " \
                   f"{c}W{mb}, on rank {owner} (its forward is marked)"
            raise _fail(schedule, what, where(f))
        if b >= 0 and i >= 0:
            raise _fail(schedule, f"{c}B{mb} and {c}I{mb} both present: use B, or I then W", where(i))
        if i >= 0 and w < 0:
            raise _fail(schedule, f"{c}I{mb} has no matching weight-gradient step {c}W{mb}", where(i))
        if w >= 0 and i < 0:
            raise _fail(schedule, f"{c}W{mb} without a split input-gradient step {c}I{mb}", where(w))


def deadlock_error(schedule: Schedule, run: Execution) -> ConfigError:
    """Explain which ranks are blocked on what, with the blocked actions marked in the grid."""
    lines = []
    for r, (i, dep) in sorted(run.stuck.items()):
        act = schedule.actions[r][i]
        need = "the output of" if dep.kind == "F" else "the input-gradient from"
        if act.kind == "W" or (dep.kind != "F" and dep.stage == act.stage):
            need = "its own"
        where = _where(schedule, r, dep, run)
        lines.append(f"  rank {r} step {i}: [{act}] waits for {need} {dep}, {where}")
    what = "deadlock in the dry run (ranks run their lists in order; receives block):\n" + "\n".join(lines)
    return _fail(schedule, what, {r: i for r, (i, _) in run.stuck.items()})


def _where(schedule: Schedule, rank: int, dep: Action, run: Execution) -> str:
    owner = schedule.placement[dep.stage]
    row = schedule.actions[owner]
    try:
        pos = row.index(dep)
    except ValueError:
        return f"which rank {owner} never runs"
    if owner == rank:
        return f"which this rank only runs later, at step {pos}"
    if owner in run.stuck and run.stuck[owner][0] <= pos:
        return f"which rank {owner} runs at step {pos}, but it is blocked at step {run.stuck[owner][0]}"
    return f"which rank {owner} runs at step {pos}"


def format_grid(schedule: Schedule, marks: dict[int, int], window: int | None = None) -> str:
    """Rows ``rank r | 0F0 0F1 [0F2] ...``; long rows are cut to a window around the marked action."""
    window = window or _WINDOW
    width = max((len(str(a)) for row in schedule.actions for a in row), default=3) + 2
    default_center = sorted(marks.values())[len(marks) // 2] if marks else 0
    lines = []
    for r, row in enumerate(schedule.actions):
        center = marks.get(r, default_center)
        lo = max(0, min(center - window // 2, len(row) - window))
        hi = min(len(row), lo + window)
        cells = [(f"[{row[j]}]" if marks.get(r) == j else f" {row[j]} ").ljust(width) for j in range(lo, hi)]
        if r in marks and marks[r] >= len(row):
            cells.append("[end]")
        pre = f"({lo} more) … " if lo > 0 else ""
        post = f" … ({len(row) - hi} more)" if hi < len(row) else ""
        lines.append(f"  rank {r:>{len(str(schedule.num_ranks - 1))}} | {pre}{''.join(cells).rstrip()}{post}")
    return "\n".join(lines)
