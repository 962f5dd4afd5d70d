"""A run that skipped a non-finite step (--on-nonfinite skip), stopped and resumed, goes on with the learning rates
and losses of the uninterrupted run: a skipped step makes no update, and the checkpoint keeps the count of updates
made (the learning-rate schedule's position), not the step number."""

from __future__ import annotations

import json

import plait.train.loop as loop
from plait.train import TrainConfig

NAN_STEP = 1  # global batch 1 (step 2) gives a NaN loss
real_train_one = loop.train_one


def _injected(run, step, trace, phases=None):
    """``train_one`` whose batch NAN_STEP reports a NaN loss (its backward ran: the skip has gradients to drop)."""
    if step != NAN_STEP:
        return real_train_one(run, step, trace, phases)
    real = run.pm.train_step
    run.pm.train_step = lambda x, y, trace=False: (real(x, y, trace=trace), float("nan"))[1]
    try:
        return real_train_one(run, step, trace, phases)
    finally:
        del run.pm.train_step


class _Rows:
    """A reporter that keeps the metrics rows."""

    def __init__(self):
        self.rows: list[dict] = []

    def begin(self, run):
        pass

    def step(self, row):
        self.rows.append(row)

    def doing(self, text):
        pass

    def saved(self, folder, nbytes):
        pass

    def end(self, run, res):
        pass


class _StopAfter:
    """A stop request agreed once step ``at`` is trained (as SIGTERM would be)."""

    name = "SIGTERM"

    def __init__(self, rows: _Rows, at: int):
        self.rows, self.at = rows, at

    def install(self):
        return self

    def agreed(self, ctx) -> bool:
        return self.rows.rows[-1]["step"] == self.at


def _cfg(tmp_path, name: str, **kw) -> TrainConfig:
    return TrainConfig.from_dict(dict(
        tp=1, pp=1, dp=1, microbatches=1, seq_len=16, batch_size=2, steps=6, lr=3e-3, warmup=2, max_data_mb=0.3,
        eval_every=0, sample_tokens=0, trace_every=0, on_nonfinite="skip", data=[str(tmp_path / "text")],
        checkpoint_dir=str(tmp_path / name), **kw))


def test_a_resumed_run_after_a_skipped_step_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("some training text, repeated with a few words more. " * 60)
    monkeypatch.setattr(loop, "train_one", _injected)
    full = _Rows()
    res = loop.train(_cfg(tmp_path, "full"), reporter=full)
    assert res.skipped == [NAN_STEP + 1] and len(full.rows) == 6, (res.skipped, full.rows)
    first = _Rows()
    stopped = loop.train(_cfg(tmp_path, "cut"), reporter=first, stop=_StopAfter(first, 3))
    assert stopped.stopped_at == 3 and stopped.skipped == [NAN_STEP + 1]
    meta = json.loads((tmp_path / "cut" / "step_00000003" / "meta.json").read_text())
    assert meta["optimizer"]["steps"] == 2, meta["optimizer"]  # steps 1 and 3 updated, step 2 was skipped
    rest = _Rows()
    loop.train(_cfg(tmp_path, "cut", resume=True), reporter=rest)
    got = [(r["step"], r["lr"], r["loss"]) for r in first.rows + rest.rows]
    want = [(r["step"], r["lr"], r["loss"]) for r in full.rows]
    assert [r["lr"] for r in rest.rows] == [r["lr"] for r in full.rows[3:]], (got, want)  # were one update ahead
    assert got[:NAN_STEP] + got[NAN_STEP + 1:] == want[:NAN_STEP] + want[NAN_STEP + 1:], (got, want)
    assert got[NAN_STEP][:2] == want[NAN_STEP][:2]  # the skipped step: its loss is NaN in both


def test_a_checkpoint_without_its_count_of_updates_resumes_at_one_update_a_step(tmp_path):
    """Checkpoints written before the count was kept (no ``optimizer.steps`` in meta.json) resume the learning-rate
    schedule at their step: load_checkpoint counts one update a step for them."""
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("some training text, repeated with a few words more. " * 60)
    full = _Rows()
    loop.train(_cfg(tmp_path, "full"), reporter=full)
    first = _Rows()
    loop.train(_cfg(tmp_path, "cut"), reporter=first, stop=_StopAfter(first, 3))
    path = tmp_path / "cut" / "step_00000003" / "meta.json"
    meta = json.loads(path.read_text())
    assert meta["optimizer"].pop("steps") == 3, meta["optimizer"]
    path.write_text(json.dumps(meta))
    rest = _Rows()
    loop.train(_cfg(tmp_path, "cut", resume=True), reporter=rest)
    assert [r["lr"] for r in rest.rows] == [r["lr"] for r in full.rows[3:]], (rest.rows, full.rows)
    assert [r["loss"] for r in rest.rows] == [r["loss"] for r in full.rows[3:]]
