"""The executor's per-schedule step plan: sends and receives pair up, every receive is posted once, early."""

from __future__ import annotations

import pytest

from plait.pipeline.step_plan import POST_SLACK, build_step_plan
from plait.schedules import SCHEDULE_NAMES, build_schedule


def _peer(pp_rank: int) -> int:
    return 10 + pp_rank  # global ranks differ from pipeline ranks, as with tp or dp > 1


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_sends_and_receives_pair_up_and_every_receive_is_posted_once(name):
    for p, m, v in ((4, 8, 2), (3, 7, 3), (2, 5, 2)):
        if name == "dualpipev" and m < 2 * p:
            continue
        s = build_schedule(name, p, m, v if name in ("interleaved-1f1b", "looped-bfs", "zb-h1") else None)
        for forward_only in (False, True):
            plans = [build_step_plan(s, r, _peer, forward_only) for r in range(p)]
            for r, plan in enumerate(plans):
                for i, send in enumerate(plan.send):
                    if send is None or send[2] < 0:
                        continue
                    kind, chunk, dst, consumer = send
                    got = plans[dst - 10].recv[consumer]
                    assert got == (kind, _peer(r), plan.actions[i].stage, i), (name, r, i)
                    assert plans[dst - 10].actions[consumer].stage == chunk
                remote = sorted(j for j, rc in enumerate(plan.recv) if rc is not None)
                posted = sorted(j for i, js in enumerate(plan.posts) for j in js)
                assert posted == remote  # each remote receive posted exactly once
                assert all(j >= i for i, js in enumerate(plan.posts) for j in js)  # never after its action


def test_receives_are_posted_before_the_message_is_expected():
    # 1F1B rank 1 of 4: the gradient of B(k) is sent while rank 1 runs F(k+2); post it earlier than that
    s = build_schedule("1f1b", 4, 8)
    plan = build_step_plan(s, 1, _peer)
    for i, js in enumerate(plan.posts):
        for j in js:
            assert j - i >= POST_SLACK or i == 0, (plan.actions[i], plan.actions[j])
    assert plan.posts[0]  # the warm-up's inputs are posted at the start
