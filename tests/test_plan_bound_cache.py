"""The search finds the parts of its lower bounds that layouts share (a layer's costs, its activations, the most
parameters a GPU holds, the DP sync) once per key, and a shared part is what that layout alone would find, whatever
field of it differs."""

from __future__ import annotations

import sys
from dataclasses import fields, replace

import pytest

from plait.errors import ConfigError
from plait.plan import Cluster, Model, Training, step_end, timing
from plait.plan import memory as mem
from plait.plan.config import Layout, check
from plait.plan.gpu import GpuCosts

search_module = sys.modules["plait.plan.search"]  # the package's ``search`` is the function


def _setup() -> tuple[Model, Cluster, Training]:
    # an MoE at 32k tokens: context parallelism (both K/V exchanges), expert placements, every schedule
    return Model.preset("mixtral-8x7b", seq_len=32768), Cluster("h100-sxm", 32), Training(64)


def _valid(model: Model, cluster: Cluster, training: Training) -> list[Layout]:
    return [lay for lay in search_module.candidates(model, cluster, training)
            if not check(model, cluster, lay, training)]


def test_the_bounds_find_each_shared_part_once_per_key(monkeypatch):
    model, cluster, training = _setup()
    valid = _valid(model, cluster, training)
    calls: dict[str, list] = {"blocks": [], "activations": [], "params": [], "sync": []}
    blocks, acts, params, sync = GpuCosts.blocks, mem.activations, mem.max_rank_split, step_end.dp_sync_parts
    monkeypatch.setattr(GpuCosts, "blocks", lambda self, m, lay, *a: calls["blocks"].append(lay) or blocks(
        self, m, lay, *a))
    monkeypatch.setattr(mem, "activations", lambda c, m, lay, t: calls["activations"].append(lay) or acts(
        c, m, lay, t))
    monkeypatch.setattr(mem, "max_rank_split", lambda m, lay: calls["params"].append(lay) or params(m, lay))
    monkeypatch.setattr(step_end, "dp_sync_parts", lambda m, c, lay, p, g, e, o: calls["sync"].append(
        (lay, p, e)) or sync(m, c, lay, p, g, e, o))
    found = search_module._bounded(model, cluster, training, False)
    assert found.considered == len(valid) + sum(n for why, n in found.rejected.items() if why != "memory")

    def keys(names):
        return {tuple(getattr(lay, f) for f in names) for lay in valid}

    assert len(calls["blocks"]) == len(keys(search_module.BLOCKS_FIELDS)) < len(valid) / 10
    assert len(calls["activations"]) == len(keys(search_module.ACTIVATIONS_FIELDS)) < len(valid) / 5
    assert len(calls["params"]) == len(keys(search_module.PARAMS_FIELDS)) < len(valid) / 10
    sync_keys = {(tuple(getattr(lay, f) for f in search_module.SYNC_FIELDS), *params(model, lay)) for lay in valid}
    assert len(calls["sync"]) == len(sync_keys) < len(valid) / 5


def _alternatives(valid: list[Layout]) -> dict[str, list]:
    values: dict[str, list] = {f.name: [] for f in fields(Layout)}
    for lay in valid:
        for name, seen in values.items():
            if getattr(lay, name) not in seen:
                seen.append(getattr(lay, name))
    values["partition"].append("uniform")
    return values


@pytest.mark.parametrize("elementwise", ["fused", "plait-eager"])
def test_a_shared_part_is_the_layouts_own_whatever_field_differs(elementwise):
    model, cluster, _ = _setup()
    training = Training(64, elementwise=elementwise)
    valid = _valid(model, cluster, training)
    values = _alternatives(valid)
    compared = 0
    for lay in valid[:: max(1, len(valid) // 40)]:
        for name, options in values.items():
            for value in options:
                if value == getattr(lay, name):
                    continue
                try:
                    other = replace(lay, **{name: value})  # valid or not: the parts need not check it
                    own_blocks = timing.layer_blocks(cluster.costs, model, other, training)
                    own_params = mem.max_rank_split(model, other)
                    own_acts = mem.activations(cluster, model, other, training)
                    own_sync = step_end.dp_sync_parts(model, cluster, other, sum(own_params), training.grad_dtype,
                                                      own_params[1], training.optimizer)
                except (ConfigError, ValueError, ZeroDivisionError):
                    continue
                shared = search_module._Shared(model, cluster, training)
                # the first layout's parts are kept (its DP sync with the other's parameters)
                shared.layer_blocks(lay), shared.max_rank_split(lay), shared.activations(lay)
                shared.dp_sync_parts(lay, sum(own_params), own_params[1])
                assert shared.layer_blocks(other) == own_blocks, (lay, name, value)
                assert shared.max_rank_split(other) == own_params, (lay, name, value)
                assert shared.activations(other) == own_acts, (lay, name, value)
                assert shared.dp_sync_parts(other, sum(own_params), own_params[1]) == own_sync, (lay, name, value)
                compared += 1
    assert compared > 500
