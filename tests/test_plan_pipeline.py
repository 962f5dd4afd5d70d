"""The planner's pipeline figures come from plait.sim; its large-M extrapolation matches exact runs."""

from dataclasses import replace

import pytest

from plait.plan.pipeline import profile
from plait.schedules import build_schedule
from plait.sim import Costs, simulate


@pytest.mark.parametrize(
    "name, pp, m, v",
    [("1f1b", 8, 45, 1), ("1f1b", 4, 30, 1), ("interleaved-1f1b", 4, 40, 2), ("interleaved-1f1b", 4, 36, 4),
     ("zb-h1", 8, 37, 1), ("zbv", 4, 29, 2), ("gpipe", 4, 22, 1), ("looped-bfs", 4, 20, 2)],
)
def test_extrapolation_equals_exact_simulation(name, pp, m, v):
    f, b, w, p2p = 0.5, 1.2, 0.45, 0.025  # ratios 2.4, 0.9, 0.05: unchanged by the 2-digit rounding
    approx = profile(name, pp, m, v, f, b, w if name in ("zb-h1", "zbv") else None, p2p)
    exact = profile(name, pp, m, v, f, b, w if name in ("zb-h1", "zbv") else None, p2p, exact=True)
    assert approx.simulated_m != (m,)  # the extrapolation was used
    assert approx.makespan == pytest.approx(exact.makespan, rel=1e-9)
    assert approx.bubble_fraction == pytest.approx(exact.bubble_fraction, rel=1e-9, abs=1e-12)
    assert approx.peak == pytest.approx(exact.peak)


def test_profile_is_the_simulator():
    p = profile("1f1b", 4, 8, 1, 1.0, 2.0, None, 0.0, exact=True)
    r = simulate(build_schedule("1f1b", stages=4, microbatches=8), Costs(1.0, 2.0, None, 0.0))
    assert p.makespan == r.makespan and p.peak == tuple(r.peak_activations)
    # and, with free communication, the textbook bubble (p-1)/(m+p-1) (Narayanan et al. 2021)
    assert p.bubble_fraction == pytest.approx(3 / 11)


def test_no_pipeline():
    p = profile("1f1b", 1, 10, 1, 1.0, 2.0, None, 0.0)
    assert p.makespan == 30.0 and p.bubble_fraction == 0.0 and p.peak == (1.0,)


@pytest.mark.parametrize("name, pp, m, v", [("interleaved-1f1b", 4, 38, 2), ("interleaved-1f1b", 8, 70, 3),
                                            ("zb-h1", 4, 39, 4), ("zb-h1", 8, 45, 2)])
def test_equal_rounds_extrapolation(name, pp, m, v):
    """M % pp != 0 with equal rounds: the round width changes with M, so peaks are counted at the true M;
    the makespan is exact with free communication and within 1% with a p2p latency."""
    w = 0.45 if name == "zb-h1" else None
    for p2p, tol in ((0.0, 1e-9), (0.025, 0.01)):
        approx = profile(name, pp, m, v, 0.5, 1.2, w, p2p)
        exact = profile(name, pp, m, v, 0.5, 1.2, w, p2p, exact=True)
        assert approx.simulated_m != (m,)
        assert approx.makespan == pytest.approx(exact.makespan, rel=tol)
        assert approx.peak == pytest.approx(exact.peak)


def test_planner_memory_budget_chooses_the_rounds():
    from plait.plan import Cluster, Layout, Model, Training, estimate

    layout = Layout(pp=8, virtual=2, schedule="interleaved-1f1b", recompute="selective")
    cluster, batch = Cluster("a100-40gb", 8), Training(global_batch=15)  # M = 15, no longer refused
    roomy = estimate(Model.preset("llama3-8b", seq_len=2048), cluster, layout, batch)
    tight = estimate(Model.preset("llama3-8b", seq_len=3072), cluster, layout, batch)
    assert roomy.fits and roomy.rounds == "equal" and roomy.peak_in_flight == 15.0
    assert roomy.bubble_fraction == pytest.approx(7 / 37, rel=0.05)  # (p-1)/(v·m+p-1), p2p aside
    # equal rounds hold 15 micro-batches; only the padded ones (11.5) fit, with a larger bubble
    assert tight.fits and tight.rounds == "padded" and tight.peak_in_flight == 11.5
    assert tight.bubble_fraction > roomy.bubble_fraction
    runnable = replace(tight.layout, recompute="none")  # the runtime has no selective recomputation
    config = runnable.to_parallel_config(batch, rounds=tight.rounds)  # what the runtime then runs
    assert config.pipeline_schedule().meta["round_widths"] == [8, 7]
    assert estimate(Model.preset("llama3-8b", seq_len=3072), cluster, Layout(pp=8), batch).rounds is None
