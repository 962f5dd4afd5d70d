"""search_batch finds each batch's lower bounds once, whatever it ranks them for (a probe of the best, then the
``top``), and ranks them as ``search`` does."""

from __future__ import annotations

import sys

from plait.plan import Cluster, Model, Training, search
from plait.plan.optimizers import RUNTIME_MASTERS
from plait.plan.search import DEFAULT_BATCH_TOKENS, search_batch

search_module = sys.modules["plait.plan.search"]  # the package's ``search`` is the function


def test_search_batch_bounds_each_layout_once_and_ranks_as_search(monkeypatch):
    model, cluster = Model.preset("llama3-8b"), Cluster("a100-80gb", 16, interconnect="ib-hdr")
    calls = []
    bounds = search_module._lower_bounds
    monkeypatch.setattr(search_module, "_lower_bounds", lambda *a: calls.append(a[2]) or bounds(*a))
    choice = search_batch(model, cluster, top=5, masters=RUNTIME_MASTERS)
    # the first batch kept the bubble under the limit: probed at top=1, then ranked at top=5, on one set of bounds
    assert choice.global_batch == DEFAULT_BATCH_TOKENS[0] // model.seq_len
    result = choice.result
    valid = result.considered - sum(n for why, n in result.rejected.items() if why != "memory")
    assert valid > 100 and len(calls) == valid == len(set(calls))
    again = search(model, cluster, Training(choice.global_batch, masters=RUNTIME_MASTERS), top=5)
    assert [(e.layout, e.step_time_s, e.memory.total) for e in result.best] == \
        [(e.layout, e.step_time_s, e.memory.total) for e in again.best]
    assert (result.rejected, result.pruned, result.considered, result.twins, result.twin_settings,
            result.smallest_memory) == (again.rejected, again.pruned, again.considered, again.twins,
                                        again.twin_settings, again.smallest_memory)
