"""Layout search: constraints honoured and sensible answers (the model against published runs: test_plan_gpu)."""

from dataclasses import replace

import pytest

from plait import ConfigError
from plait.plan import Cluster, Layout, Model, Training, estimate, explain, search


def test_search_honours_node_size_heads_layers_and_memory():
    # 12 heads and 12 layers on 16 GPUs of 4 per node: tp=8/16 break the node, tp=8 also the heads,
    # pp=16 the layers.
    m = Model(12, 1536, 12, 32000, 2048, glu=True, ffn_hidden=4096)
    r = search(m, Cluster("a100-40gb", 16, gpus_per_node=4), Training(64), top=50)
    assert r.best
    for e in r.best:
        lay = e.layout
        assert lay.tp <= 4 and m.n_heads % lay.tp == 0 and lay.pp <= m.n_layers
        assert lay.tp * lay.pp * lay.dp * lay.cp == 16 and 64 % (lay.dp * lay.microbatch_size) == 0
        assert e.fits and e.memory.total <= e.memory.usable
    assert r.rejected["tp>node"] > 0 and r.rejected["layers<stages"] > 0
    steps = [e.step_time_s for e in r.best]
    assert steps == sorted(steps)


def test_search_rejects_for_memory():
    r = search(Model.preset("llama3-8b"), Cluster("a100-40gb", 2, gpus_per_node=2), Training(16))
    assert r.rejected["memory"] > 0
    assert all(e.fits for e in r.best)


def test_70b_on_64_h100():
    r = search(Model.preset("llama3-70b"), Cluster("h100-sxm", 64, gpus_per_node=8), Training(512))
    best = r.best[0]
    lay = best.layout
    assert best.fits
    # 70B must be cut at least 8 ways: by TP and a pipeline, or by TP and sharding the weights (ZeRO-3)
    assert lay.tp in (2, 4, 8) and (lay.tp * lay.pp >= 8 or lay.zero == 3)
    assert 0.30 < best.mfu < 0.60
    lines = explain(r)
    assert lines[0].startswith("best: ") and any("faster than" in ln for ln in lines)


def test_explain_names_each_layout_it_compares_once():
    # 405B on 16,384 H100 (unfused attention, where selective recomputation differs from none): the runner-up is
    # already of another tp/pp/dp shape than the best, so no second line sets the same layout beside it again
    r = search(Model.preset("llama3-405b"), Cluster("h100-sxm", 16384, flash_attention=False), Training(4096), top=5)
    best, runner = r.best[0], r.best[1]
    assert (best.layout.tp, best.layout.pp, best.layout.dp) != (runner.layout.tp, runner.layout.pp, runner.layout.dp)
    lines = explain(r)
    compared = [ln for ln in lines if ln.startswith("vs ")]
    assert compared == [ln for ln in compared if ln.startswith("vs runner-up")]
    assert len(compared) == 1 and runner.layout.short() in compared[0]


def test_nothing_fits_reports_the_smallest_need():
    r = search(Model.preset("llama3-405b"), Cluster("a100-80gb", 8), Training(64))
    assert not r.best and r.smallest_memory > 80e9


def test_nothing_fits_quotes_a_need_above_the_memory_and_says_which_part_outgrows_it():
    """Llama 3 8B at 131,072 tokens on 2 H100s: 'no layout fits: the leanest needs 72.8 GB per GPU of 77.3 usable'
    (a lower bound of a layout whose full count, 81.4 GB, did not fit) and 'model states alone need >= 2 such GPUs
    (... or a smaller global batch)' with 2 there. The need quoted is now above the memory, and the line says that
    the activations, not the model states, are what outgrow it; the states' case says how many GPUs hold them."""
    from plait.plan.explain import nothing_fits

    model, cluster = Model.preset("llama3-8b", 131072), Cluster("h100-sxm", 2)
    r = search(model, cluster, Training(2, masters="plait"))  # as plait plan plans it
    assert not r.best and r.smallest_memory > cluster.usable_memory
    line = nothing_fits(r, model, cluster.usable_memory, cluster.n_gpus)
    assert line.endswith("of 77.3 usable; the model states fit (2 such GPUs hold them), the activations of "
                         "131,072-token sequences do not: a shorter sequence, more GPUs to split them over, or a "
                         "larger GPU"), line
    big, eight = Model.preset("llama3-405b"), Cluster("a100-80gb", 8)
    line = nothing_fits(search(big, eight, Training(64)), big, eight.usable_memory, eight.n_gpus)
    assert line.endswith("model states alone need ≥ 95 such GPUs (use at least 95, or a larger GPU)"), line


def test_estimate_rejects_invalid_layouts_naming_the_parameter():
    m, c, t = Model.preset("llama3-70b"), Cluster("h100-sxm", 64), Training(512)
    with pytest.raises(ConfigError, match="tp"):
        estimate(m, c, Layout(tp=16, pp=4, dp=1), t)
    with pytest.raises(ConfigError, match="n_gpus"):
        estimate(m, c, Layout(tp=8, pp=4, dp=1), t)
    with pytest.raises(ConfigError, match="global_batch"):
        estimate(m, c, Layout(tp=8, pp=2, dp=4, microbatch_size=3), t)
    with pytest.raises(ConfigError, match="recompute"):
        Layout(recompute="some")
    with pytest.raises(ConfigError, match="h100-sxm"):
        Cluster("h1000", 8)


def test_breakdown_adds_up():
    lay = Layout(tp=8, pp=4, dp=2, sequence_parallel=True, recompute="selective", zero=1)
    # unfused attention: selective recomputation redoes its softmax (fused flash attention already recomputes)
    e = estimate(Model.preset("llama3-70b"), Cluster("h100-sxm", 64, flash_attention=False), lay, Training(512))
    assert sum(e.time.values()) == pytest.approx(e.step_time_s)
    assert e.time["pp_bubble"] > 0 and e.time["tp_comm"] > 0 and e.time["recompute"] > 0


def test_pruning_keeps_the_exhaustive_top():
    # Branch and bound skips simulations whose lower bound is already slower than the top-k; the
    # answer must equal evaluating every valid layout.
    from plait.plan.config import check
    from plait.plan.search import candidates

    m, c, t = Model.preset("llama3-8b", seq_len=4096), Cluster("a100-80gb", 16), Training(128)
    r = search(m, c, t, top=4)
    every = [estimate(m, c, lay, t) for lay in candidates(m, c, t) if check(m, c, lay, t) is None]
    # twins of equal time (ZeRO-1/2, selective/no recomputation) ranked once: less memory, else ZeRO-1, "none"
    ranked: dict = {}
    order = {"none": 0, "selective": 1, "full": 0}
    for e in (e for e in every if e.fits):
        lay = e.layout
        key = (replace(lay, zero=1 if lay.zero == 2 else lay.zero,
                       recompute="none" if lay.recompute == "selective" else lay.recompute), e.step_time_s)
        if key not in ranked or ((e.memory.total, lay.zero, order[lay.recompute])
                                 < (ranked[key].memory.total, ranked[key].layout.zero,
                                    order[ranked[key].layout.recompute])):
            ranked[key] = e
    exhaustive = sorted(ranked.values(), key=lambda e: e.step_time_s)[:4]
    assert [e.step_time_s for e in r.best] == [e.step_time_s for e in exhaustive]
    assert r.pruned > 0


def test_search_result_reads_as_the_ranked_list():
    from plait.plan import Cluster, Model, Training, search

    res = search(Model.preset("llama3-8b"), Cluster("h100-sxm", 8), Training(global_batch=64), top=3)
    ranked = list(res)
    assert len(res) == len(ranked) == len(res.best) > 0
    assert res[0] is res.best[0] and ranked == res.best
    assert [e.step_time_s for e in ranked] == sorted(e.step_time_s for e in ranked)


def test_top_may_be_a_numpy_integer_never_a_bool():
    """``top`` is checked by plait.errors.is_integer: numpy's integers are counts (a user's arithmetic makes them);
    True, which Python counts as 1, is refused naming ``top`` rather than read as one layout."""
    import numpy as np

    from plait.plan.search import search_batch

    model, cluster, training = Model.preset("llama3-8b"), Cluster("h100-sxm", 8), Training(64)
    assert search(model, cluster, training, top=np.int64(2)).best == search(model, cluster, training, top=2).best
    for call in (lambda: search(model, cluster, training, top=True), lambda: search_batch(model, cluster, top=True)):
        with pytest.raises(ConfigError, match=r"top=True: how many layouts to keep, must be >= 1"):
            call()


def test_lower_bound_holds_with_megatron_overlaps():
    """The search skips a layout whose lower bound is slower than the top-k: with TP communication and the
    weights' gather overlapped (and every DP reduction chunk by chunk), no bound may exceed the estimate."""
    from plait.plan.config import check
    from plait.plan.search import _lower_bounds, candidates

    m, c = Model.preset("llama3-8b", seq_len=4096), Cluster("h100-sxm", 16)
    t = Training(64, tp_comm_overlap=True, overlap_param_gather=True)
    seen = 0
    for lay in candidates(m, c, t):
        if check(m, c, lay, t) is None and lay.zero in (1, 2) and lay.pp > 1:
            assert _lower_bounds(m, c, lay, t)[0] <= estimate(m, c, lay, t).step_time_s * (1 + 1e-9), lay.short()
            seen += 1
    assert seen > 20


def test_selective_recomputation_under_fused_attention_is_ranked_once():
    """Fused (flash) attention already recomputes its scores in the backward, so selective recomputation redoes
    nothing: a layout with it and the same layout without take the same time and memory, and only the one
    without is ranked (else 8B on 8 H100 lists three such pairs in its top 5)."""
    m, t = Model.preset("llama3-8b"), Training(64)
    r = search(m, Cluster("h100-sxm", 8), t, top=5)
    assert len(r.best) == 5 and all(e.layout.recompute != "selective" for e in r.best)
    for e in r.best:  # each ranked layout has a selective twin of the same time and memory that was left out
        sel = estimate(m, Cluster("h100-sxm", 8), replace(e.layout, recompute="selective"), t)
        assert (sel.step_time_s, sel.memory.total) == (e.step_time_s, e.memory.total)
    assert r.twin_settings["recompute"] >= 5 and r.twins == sum(r.twin_settings.values())
    assert any("selective/no recomputation" in ln and f"{r.twins} layouts" in ln for ln in explain(r))
    # unfused attention: selective recomputation redoes the softmax, costs time, and both are ranked
    unfused = search(m, Cluster("h100-sxm", 8, flash_attention=False), t, top=20)
    assert "recompute" not in unfused.twin_settings
    assert {e.layout.recompute for e in unfused.best} >= {"none", "selective"}
