"""Context parallelism: the layout dimension cp (configuration, mesh order, groups)."""

from __future__ import annotations

import pytest

from checks_context import MESHES
from harness import result
from plait.errors import ConfigError
from plait.parallel_config import ParallelConfig

# world4: tests/conftest.py (one launch of 4 ranks shared with the other world-4 modules runs checks_context)


@pytest.mark.parametrize("name", sorted(MESHES))
def test_mesh_order_tp_innermost_then_cp_dp_pp(world4, name):
    rows = result(world4, f"mesh/{name}")
    assert sorted(r["coords"] for r in rows) == sorted({r["coords"] for r in rows}), "two ranks share coordinates"
    for r in rows:
        assert r["formula"] == r["rank"], r
        assert r["cp_group_ok"] and r["dp_cp_group_ok"] and r["pp_peer_ok"], r


def test_cp_one_keeps_every_rank_formula():
    cfg = ParallelConfig(tp=2, pp=2).resolve(8)
    assert (cfg.cp, cfg.dp, cfg.world) == (1, 2, 8)
    assert ParallelConfig(tp=2, cp=2, pp=2).resolve(16).dp == 2


@pytest.mark.parametrize("kw,world,needles", [
    (dict(cp=0), None, ["cp=0", "positive"]),
    (dict(cp_comm="p2p"), None, ["cp_comm='p2p'", "allgather, ring"]),
    (dict(tp=2, cp=3), 8, ["tp*cp*pp=2*3*1=6", "world size 8"]),
    (dict(tp=2, cp=2, dp=4), 8, ["tp*cp*pp*dp", "world size is 8"]),
    (dict(cp=2, dp=1, ep=4), None, ["ep=4", "dp*cp*tp=2"]),
    (dict(tp=2, cp=2, dp=1, ep=4, expert_tp=True), None, ["ep=4", "dp*cp=2", "expert_tp"]),
])
def test_bad_cp_is_a_config_error_naming_it(kw, world, needles):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**kw).resolve(world) if world else ParallelConfig(**kw)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
