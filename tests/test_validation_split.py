"""The per-micro-batch / per-step split of a published source's step (``plan.validation_split``)."""

from dataclasses import replace

import pytest

from plait.plan.published import runs
from plait.plan.validation import predict
from plait.plan.validation_split import format_splits, line, microbatch_splits


def _mtnlg():
    return [r for r in runs() if r.source.startswith("Smith et al.")]


def test_line_is_least_squares():
    assert line([(1, 5.0), (2, 7.0), (4, 11.0)]) == pytest.approx((2.0, 3.0))
    # off the line: the fit splits the residuals, (0, 0), (1, 2), (2, 1) -> slope 0.5, intercept 0.5
    assert line([(0, 0.0), (1, 2.0), (2, 1.0)]) == pytest.approx((0.5, 0.5))
    with pytest.raises(ValueError, match="two distinct"):
        line([(3, 1.0), (3, 2.0)])


def test_a_cost_paid_once_a_step_shows_in_the_intercept_not_the_slope():
    # published = predicted + 5 s a step: the slopes agree and the model misses 5 s a step
    rs = [replace(r, step_s=predict(r) + 5.0) for r in _mtnlg()]
    (s,) = microbatch_splits(rs)
    assert s.microbatches == (240, 192, 160)
    assert s.slope_ratio == pytest.approx(1.0, abs=1e-9)
    assert s.step_gap_s == pytest.approx(-5.0, abs=1e-9)


def test_a_cost_per_micro_batch_shows_in_the_slope():
    # published = predicted x 1.25: each micro-batch 25% dearer, the step's fixed part too
    rs = [replace(r, step_s=1.25 * predict(r)) for r in _mtnlg()]
    (s,) = microbatch_splits(rs)
    assert s.slope_ratio == pytest.approx(0.8)
    assert s.step_gap_s == pytest.approx(-0.25 * s.predicted[1])


def test_groups_take_only_runs_that_differ_in_their_data_parallel_degree():
    rs = _mtnlg()
    assert len(microbatch_splits(rs)) == 1
    # another global batch for one run leaves two runs alike: under the three micro-batch counts asked for
    changed = [rs[0], rs[1], replace(rs[2], training=replace(rs[2].training, global_batch=2400))]
    assert microbatch_splits(changed) == []
    assert len(microbatch_splits(changed, least=2)) == 1
    # another micro-batch size for one run: likewise
    other = replace(rs[2], layout=replace(rs[2].layout, microbatch_size=2))
    assert microbatch_splits([rs[0], rs[1], other]) == []


def test_the_published_set_has_the_groups_the_docs_print():
    """MT-NLG's three runs and NeMo's five 175B runs each form a group; the published line is the set's data alone
    (MT-NLG: 60.1, 50.2 and 44.4 s at 240, 192 and 160 micro-batches)."""
    splits = {s.label: s for s in microbatch_splits(runs())}
    mtnlg, nemo = splits["mt-nlg-530b t8 p35 mbs1 batch 1920"], splits["gpt3-175b t8 p8 mbs2 batch 2048"]
    assert mtnlg.microbatches == (240, 192, 160) and nemo.microbatches == (1024, 512, 256, 128, 64)
    assert mtnlg.published == pytest.approx(line([(240, 60.1), (192, 50.2), (160, 44.4)]))
    assert mtnlg.published == pytest.approx((0.19704, 12.684), rel=1e-4)
    text = format_splits([mtnlg, nemo])
    assert "mt-nlg-530b t8 p35 mbs1 batch 1920" in text and "m 240,192,160" in text
