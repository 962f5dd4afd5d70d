"""What each action of one rank's list receives, sends and pre-posts: worked out once per schedule.

The executor's per-action work is then a few list lookups. The one decision here that matters for speed
is *when* a receive is posted. Gloo sends a message at once only if the receiver has already posted
the matching receive (its transport announces posted receives to the sender); otherwise the sender
announces the message and waits for the receive, and the data crosses one round trip later. So each
receive is posted a few actions before its message is expected: where, in a dry run of the schedule
with nominal costs (``plait.schedules.execute``), the producer finishes, less ``POST_SLACK`` of this
rank's actions. Posting every receive at the start of a step would hold a buffer per message for the
whole step; this holds only those about to arrive.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.pipeline.p2p import ACT, GRAD
from plait.schedules import Action, Schedule
from plait.schedules.execute import execute

POST_SLACK = 4  # post a receive this many of the receiver's actions before its message is expected


@dataclass(frozen=True)
class StepPlan:
    """The per-action facts of one rank's list (``actions`` as run: all of them, or the forwards only)."""

    actions: list[Action]
    #: per action, the message it waits for: (kind, source global rank, source chunk, index of the producing
    #: action in the source's list), or None if its input is local
    recv: list[tuple[int, int, int, int] | None]
    #: per action, where its output goes: (kind, destination chunk, destination global rank or -1 if local,
    #: index of the consuming action in the destination's list), or None (nothing to send)
    send: list[tuple[int, int, int, int] | None]
    #: per action, the indices of later actions whose receives to post before it runs
    posts: list[list[int]]


def build_step_plan(schedule: Schedule, rank: int, peer_of_rank, forward_only: bool = False) -> StepPlan:
    """The plan of ``schedule.actions[rank]`` (only its forwards if ``forward_only``)."""
    rows = [[a for a in row if a.kind == "F"] if forward_only else row for row in schedule.actions]
    position = [{_key(a): i for i, a in enumerate(row) if a.kind != "W"} for row in rows]
    place, last = schedule.placement, schedule.num_stages - 1
    recv: list = []
    send: list = []
    for a in rows[rank]:
        src = _source(a, last)
        if src is None or place[src] == rank:
            recv.append(None)
        else:
            kind = ACT if a.kind == "F" else GRAD
            producer = position[place[src]][("F" if kind == ACT else "B", src, a.microbatch)]
            recv.append((kind, peer_of_rank(place[src]), src, producer))
        dst = _destination(a, last, forward_only)
        if dst is None:
            send.append(None)
        else:
            kind = ACT if a.kind == "F" else GRAD
            consumer = position[place[dst]][("F" if kind == ACT else "B", dst, a.microbatch)]
            send.append((kind, dst, -1 if place[dst] == rank else peer_of_rank(place[dst]), consumer))
    return StepPlan(rows[rank], recv, send, _posts(schedule, rows, rank, recv))


def _key(a: Action) -> tuple[str, int, int]:
    return ("F" if a.kind == "F" else "B", a.stage, a.microbatch)  # I takes the gradient as B does


def _source(a: Action, last: int) -> int | None:
    """The chunk whose output (F) or input gradient (B, I) action ``a`` consumes, if any."""
    if a.kind == "F":
        return a.stage - 1 if a.stage > 0 else None
    if a.kind in ("B", "I"):
        return a.stage + 1 if a.stage < last else None
    return None


def _destination(a: Action, last: int, forward_only: bool) -> int | None:
    if a.kind == "F":
        return a.stage + 1 if a.stage < last else None
    if a.kind in ("B", "I") and not forward_only:
        return a.stage - 1 if a.stage > 0 else None
    return None


def _posts(schedule: Schedule, rows: list[list[Action]], rank: int, recv: list) -> list[list[int]]:
    """For each action, the receives (indices of later actions) to post just before it runs."""
    dry = Schedule(schedule.name, schedule.num_ranks, schedule.virtual, schedule.microbatches,
                   schedule.placement, rows)
    n = schedule.num_stages
    run = execute(dry, {"F": [1.0] * n, "B": [2.0] * n, "I": [1.0] * n, "W": [1.0] * n})
    starts = run.starts[rank]
    posts: list[list[int]] = [[] for _ in rows[rank]]
    if not run.finished:  # cannot happen for a validated schedule; post each receive at its own action
        for j, r in enumerate(recv):
            if r is not None:
                posts[j].append(j)
        return posts
    i = 0
    sent_at = {j: run.ends[schedule.placement[r[2]]][r[3]] for j, r in enumerate(recv) if r is not None}
    for j in sorted(sent_at, key=lambda k: sent_at[k]):  # when the producer ends, in the dry run
        sent = sent_at[j]
        while i + 1 < len(starts) and starts[i + 1] <= sent:
            i += 1
        posts[max(0, min(i, j) - POST_SLACK)].append(j)
    return posts
