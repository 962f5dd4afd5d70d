"""Training on a prepared dataset: the data of a step does not depend on the layout, and resumes exactly."""

from checks_data import CHAT_LAYOUTS, LAYOUTS
from harness import result

# world4: tests/conftest.py (one launch of 4 ranks shared with the other world-4 modules runs checks_data)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def test_same_losses_under_dp2_tp2_pp2_as_on_one_device(world4):
    for rank, r in enumerate(result(world4, "data/layouts")):
        for name in LAYOUTS:
            assert _rel(r[name]["losses"], r["single"]) <= 1e-5, f"rank {rank} {name}: {r[name]} vs {r['single']}"
            assert abs(r[name]["held_out"] - r["tp2pp2"]["held_out"]) <= 1e-5 * r["tp2pp2"]["held_out"], (rank, r)
        assert r["single"][-1] < r["single"][0]


def test_resume_continues_the_stream_exactly_also_under_another_layout(world4):
    for rank, r in enumerate(result(world4, "data/layouts")):
        full = r["tp2pp2"]["losses"][3:]
        resumed = result(world4, "data/resume")[rank]
        assert resumed["tp2pp2"]["started"] == 4 and resumed["tp2pp2"]["losses"] == full, (rank, resumed, full)
        assert resumed["dp2tp2"]["started"] == 4 and _rel(resumed["dp2tp2"]["losses"], full) <= 1e-5, (rank, resumed)


def test_a_chat_datasets_masked_loss_is_the_same_under_dp_tp_pp_as_on_one_device(world4):
    for rank, r in enumerate(result(world4, "data/chat")):
        for name in CHAT_LAYOUTS:
            assert _rel(r[name], r["single"]) <= 1e-5, f"rank {rank} {name}: {r[name]} vs {r['single']}"
        assert r["single"][-1] < r["single"][0]
