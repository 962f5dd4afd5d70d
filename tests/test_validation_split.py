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


def test_the_published_set_splits_as_the_log_reads_it():
    """planner-log entry 31: MT-NLG's miss is paid once a step, NeMo's 175B rows' per micro-batch."""
    splits = {s.source: s for s in microbatch_splits(runs()) if s.label.startswith(("mt-nlg", "gpt3-175b"))}
    mtnlg, nemo = splits["Smith et al. 2022 (MT-NLG)"], splits["NVIDIA NeMo Megatron"]
    assert abs(mtnlg.slope_ratio - 1) < 0.05 and mtnlg.step_gap_s < -4.0
    assert nemo.slope_ratio < 0.85 and abs(nemo.step_gap_s) < 2.0
    text = format_splits(list(splits.values()))
    assert "mt-nlg-530b t8 p35 mbs1 batch 1920" in text and "gpt3-175b t8 p8 mbs2 batch 2048" in text
