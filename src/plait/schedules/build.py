"""``build_schedule``: parameter checks and dispatch to the schedule generators."""

from __future__ import annotations

from typing import Any

from plait.errors import FieldError, is_integer
from plait.schedules import generators as gen
from plait.schedules import zero_bubble as zb
from plait.schedules.schedule import Schedule, loop_placement, v_placement

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "dualpipev")

#: schedule -> (allowed virtual values or None for "any >= 1", default virtual)
_VIRTUAL: dict[str, tuple[tuple[int, ...] | None, int]] = {
    "gpipe": ((1,), 1),
    "1f1b": ((1,), 1),
    "zb-h1": (None, 1),  # V > 1: ZB1P, the interleaved zero-bubble schedule
    "interleaved-1f1b": (None, 2),
    "looped-bfs": (None, 2),
    "zbv": ((1, 2), 2),  # the V shape is exactly two chunks per rank; 1 means "the default"
    "dualpipev": ((1, 2), 2),
}


#: schedules whose depth-first micro-batch rounds ``build_schedule(rounds=...)`` chooses
ROUND_SCHEDULES = ("interleaved-1f1b", "zb-h1")


def _resolve_rounds(name: str, rounds: str | None) -> str:
    if rounds is None:
        return "equal"
    if name not in ROUND_SCHEDULES:
        raise FieldError("rounds", rounds, f"only {' and '.join(ROUND_SCHEDULES)} group micro-batches into rounds "
                                           f"({' or '.join(gen.ROUNDS)}); leave it unset for {name}")
    if rounds not in gen.ROUNDS:
        raise FieldError("rounds", rounds, f"use one of {', '.join(gen.ROUNDS)}")
    return rounds


def _positive_int(name: str, value: Any) -> int:
    if not is_integer(value) or value < 1:
        raise FieldError(name, value, "must be an integer >= 1")
    return int(value)


def _resolve_virtual(name: str, virtual: int | None) -> int:
    allowed, default = _VIRTUAL[name]
    if virtual is None:
        return default
    v = _positive_int("virtual", virtual)
    if allowed is not None and v not in allowed:
        if default == 1:
            hint = "use 1, or interleaved-1f1b / looped-bfs / zb-h1 for several chunks per rank"
        else:
            hint = "use 2 (or leave it unset)"
        raise FieldError("virtual", virtual, f"{name} places exactly {default} chunk(s) per rank; {hint}")
    return default if allowed is not None else v


def build_schedule(
    name: str,
    stages: int,
    microbatches: int,
    virtual: int | None = None,
    validate: bool = False,
    rounds: str | None = None,
) -> Schedule:
    """Build the named schedule for ``stages`` pipeline ranks and ``microbatches`` micro-batches.

    ``virtual`` is the number of chunks per rank (``None``: 1, or 2 for interleaved-1f1b, looped-bfs,
    zbv and dualpipev). Placement: round-robin (chunk ``c`` on rank ``c % stages``) for all but zbv and
    dualpipev, which use the V shape (chunk ``c`` on rank ``c`` if ``c < stages`` else
    ``2·stages-1-c``). Raises ``plait.ConfigError`` naming the bad parameter. ``validate=True`` also
    dry-runs the result (every generator is tested to validate, so this is off by default).

    ``rounds`` (interleaved-1f1b and zb-h1 only; ``None`` means ``"equal"``) groups the micro-batches of
    the depth-first order when ``M % stages != 0``: ``"equal"`` rounds reach the bubble
    ``(P-1)/(V·M+P-1)`` (PyTorch's order), ``"padded"`` rounds of ``stages`` hold fewer micro-batches
    (Megatron's order); see ``generators.round_widths``.
    """
    key = str(name).strip().lower()
    if key not in SCHEDULE_NAMES:
        raise FieldError("schedule", name, f"unknown; valid names are {', '.join(SCHEDULE_NAMES)}")
    p = _positive_int("stages", stages)
    m = _positive_int("microbatches", microbatches)
    v = _resolve_virtual(key, virtual)
    rnd = _resolve_rounds(key, rounds)
    if key == "dualpipev" and m < 2 * p:
        raise FieldError("microbatches", m, f"dualpipev needs at least 2 per pipeline stage, {2 * p} for {p} stages "
                                            "(DualPipe's num_chunks >= 2*num_ranks); use more micro-batches or zbv")
    actions = {
        "gpipe": lambda: gen.gpipe(p, m),
        "1f1b": lambda: gen.one_f_one_b(p, m),
        "interleaved-1f1b": lambda: gen.interleaved_1f1b(p, m, v, rnd),
        "looped-bfs": lambda: gen.looped_bfs(p, m, v),
        "zb-h1": lambda: zb.zb_h1(p, m, v, rnd),
        "zbv": lambda: zb.zbv(p, m),
        "dualpipev": lambda: zb.dualpipev(p, m),
    }[key]()
    placement = v_placement(p) if key in ("zbv", "dualpipev") else loop_placement(p, v)
    meta = {"rounds": rnd, "round_widths": gen.round_widths(p, m, rnd)} if key in ROUND_SCHEDULES else {}
    sched = Schedule(name=key, num_ranks=p, virtual=v, microbatches=m, placement=placement, actions=actions,
                     meta=meta)
    return sched.validate() if validate else sched
