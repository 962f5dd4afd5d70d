"""Tests of the schedule IR, generators, parameter checks and validation (pure Python, no torch)."""

from __future__ import annotations

import pytest

from plait.errors import ConfigError
from plait.schedules import SCHEDULE_NAMES, Action, Schedule, build_schedule, parse_actions

MULTI = ("interleaved-1f1b", "looped-bfs", "zb-h1")


def grid_cases():
    for name in SCHEDULE_NAMES:
        for p in (1, 2, 3, 4, 5):
            for m in (1, 2, 3, 4, 5, 7, 8, 12):
                if name == "dualpipev" and m < 2 * p:
                    continue
                for v in ((1, 2, 3) if name in MULTI else (None,)):
                    yield name, p, m, v


@pytest.mark.parametrize("text", ["0F0", "2F0", "1I3", "12W7", "3B10"])
def test_action_string_round_trip(text):
    act = Action.parse(text)
    assert str(act) == text
    assert Action.parse(str(act)) == act


def test_action_fields_and_parse_errors():
    assert Action.parse("2F0") == Action("F", 2, 0)
    assert Action.parse(" 1I3 ") == Action(kind="I", stage=1, microbatch=3)
    for bad in ("F0", "2X0", "2F", "", "-1F0", "1UNSHARD"):
        with pytest.raises(ConfigError, match="<stage><kind><microbatch>"):
            Action.parse(bad)
    assert parse_actions("0F0, 0F1,,0B0") == [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0)]


def test_every_generator_validates_over_a_grid():
    count = 0
    for name, p, m, v in grid_cases():
        s = build_schedule(name, stages=p, microbatches=m, virtual=v)
        s.validate()
        assert s.num_ranks == p and s.microbatches == m and s.num_stages == p * s.virtual
        assert s.num_actions >= 2 * s.num_stages * m  # every (chunk, mb) has F and B or I+W
        count += 1
    assert count > 250


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_placement_maps(name):
    p = 4
    s = build_schedule(name, stages=p, microbatches=8, virtual=3 if name in MULTI else None)
    if name in ("zbv", "dualpipev"):
        assert s.virtual == 2
        assert [s.stage_to_rank(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
        assert s.stages_of_rank(0) == [0, 7] and s.stages_of_rank(3) == [3, 4]
    else:
        assert [s.stage_to_rank(c) for c in range(s.num_stages)] == [c % p for c in range(s.num_stages)]
        assert s.stages_of_rank(1) == list(range(1, s.num_stages, p))
    for r, row in enumerate(s.actions):
        assert {s.stage_to_rank(a.stage) for a in row} == {r}


def test_known_orders():
    assert " ".join(map(str, build_schedule("1f1b", 4, 6).actions[1])) == (
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5")
    assert [str(a) for a in build_schedule("gpipe", 2, 1).actions[0]] == ["0F0", "0B0"]  # naive
    # Megatron's interleaved order: groups of P micro-batches per chunk
    row = [str(a) for a in build_schedule("interleaved-1f1b", 2, 4, 2).actions[1]]
    assert row[:6] == ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1"]  # last rank: warm-up (V-1)P
    bfs = [str(a) for a in build_schedule("looped-bfs", 2, 2, 2).actions[0]]
    assert bfs == ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"]
    zb = build_schedule("zb-h1", 3, 6)
    assert {a.kind for row in zb.actions for a in row} == {"F", "I", "W"}


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"name": "nope", "stages": 4, "microbatches": 8}, "schedule='nope': unknown; valid names are gpipe"),
        ({"name": "1f1b", "stages": 0, "microbatches": 8}, "stages=0: must be an integer >= 1"),
        ({"name": "1f1b", "stages": 4, "microbatches": 0}, "microbatches=0"),
        ({"name": "1f1b", "stages": 4, "microbatches": 2.5}, "microbatches=2.5"),
        ({"name": "gpipe", "stages": 4, "microbatches": 8, "virtual": 2}, "virtual=2: gpipe"),
        ({"name": "1f1b", "stages": 4, "microbatches": 8, "virtual": 3}, "zb-h1 for several chunks"),
        ({"name": "1f1b", "stages": 4, "microbatches": 6, "rounds": "padded"},  # the choices were not named
         "rounds='padded': only interleaved-1f1b and zb-h1 group micro-batches into rounds (equal or padded); leave "
         "it unset for 1f1b"),
        ({"name": "zb-h1", "stages": 4, "microbatches": 6, "rounds": "torch"}, "use one of equal, padded"),
        ({"name": "zbv", "stages": 4, "microbatches": 8, "virtual": 3}, "virtual=3: zbv places exactly 2"),
        ({"name": "dualpipev", "stages": 4, "microbatches": 4, "virtual": 4}, "virtual=4"),
        ({"name": "dualpipev", "stages": 4, "microbatches": 7}, "microbatches=7: dualpipev needs at least"),
        ({"name": "interleaved-1f1b", "stages": 4, "microbatches": 8, "virtual": 0}, "virtual=0"),
    ],
)
def test_bad_parameters_raise_config_error(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        build_schedule(**kwargs)
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)


def test_v_schedules_accept_default_virtual():
    for v in (None, 1, 2):
        assert build_schedule("zbv", 3, 6, virtual=v).virtual == 2
        assert build_schedule("dualpipev", 3, 6, virtual=v).virtual == 2
    assert build_schedule("interleaved-1f1b", 3, 6).virtual == 2
    assert build_schedule("1f1b", 3, 6, virtual=1).virtual == 1


def test_interleaved_generalised_to_any_microbatch_count():
    # Megatron needs M % P == 0; plait's rounds take any M, both ways
    for m in (5, 6, 7, 9, 13):
        for rounds in ("equal", "padded"):
            s = build_schedule("interleaved-1f1b", 4, m, 2, rounds=rounds).validate()
            assert max(a.microbatch for row in s.actions for a in row) == m - 1
            assert sum(s.meta["round_widths"]) == m and s.meta["rounds"] == rounds


def test_json_round_trip(tmp_path):
    for name in SCHEDULE_NAMES:
        s = build_schedule(name, 3, 6)
        back = Schedule.from_json(s.to_json())
        assert back.actions == s.actions and back.placement == s.placement
        assert (back.name, back.virtual, back.microbatches, back.num_stages) == (
            s.name, s.virtual, s.microbatches, s.num_stages)
    path = tmp_path / "s.json"
    s.to_json(path, indent=1)
    assert Schedule.from_json(path).actions == s.actions
    with pytest.raises(ConfigError, match="missing field 'placement'"):
        Schedule.from_dict({"num_ranks": 1, "virtual": 1, "microbatches": 1, "actions": []})


def test_schedule_str_and_accessor_errors():
    s = build_schedule("1f1b", 2, 2)
    assert str(s).splitlines()[1].split() == ["rank", "0", "|", "0F0", "0F1", "0B0", "0B1"]
    with pytest.raises(ConfigError, match="chunk=5"):
        s.stage_to_rank(5)
    with pytest.raises(ConfigError, match="rank=2"):
        s.stages_of_rank(2)
