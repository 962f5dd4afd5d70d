"""plait train --resume / --auto-resume when the checkpoint it finds is at or past --steps: the run is complete,
it says so with how to train on, and exits 0 with nothing trained (before any launch from the command; in the
worker under torchrun, before the prediction and the header's step range)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from plait.cli.main import app
from plait.train import TrainConfig
from plait.train.loop import train
from plait.train.report import Reporter


@pytest.mark.parametrize("flag,steps", [("--resume", 5), ("--auto-resume", 5), ("--auto-resume", 3)])
def test_a_complete_run_says_so_and_launches_nothing(tmp_path, flag, steps):
    from plait.checkpoint.store import FORMAT, META

    done = tmp_path / "ckpt" / "step_00000005"
    done.mkdir(parents=True)
    (done / META).write_text(json.dumps({"format": FORMAT, "step": 5}))
    res = CliRunner().invoke(app, ["train", flag, "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", str(steps)])
    assert res.exit_code == 0, res.output
    past = "" if steps == 5 else f", past --steps {steps}"
    assert res.output == (f"plait train: the run is already complete at step 5{past} ({done}); nothing to train. To "
                          f"train on, give a larger --steps (above 5) with {flag}.\n")


def _cfg(tmp_path, **kw) -> TrainConfig:
    return TrainConfig.from_dict({
        **dict(tp=1, pp=1, dp=1, microbatches=1, seq_len=16, batch_size=2, lr=3e-3, warmup=1, max_data_mb=0.3,
               eval_every=0, sample_tokens=0, trace_every=0, data=[str(tmp_path / "text")],
               checkpoint_dir=str(tmp_path / "ckpt")), **kw})


def test_a_worker_resuming_a_complete_run_trains_nothing_and_prints_no_step_range(tmp_path):
    """As under torchrun, where the worker itself finds the checkpoint: it printed 'steps 3..2 (resumed at 2)',
    then a summary of no steps (loss nan -> nan) and drew a sample."""
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("some training text, repeated with a few words more. " * 60)
    first = train(_cfg(tmp_path, steps=2))
    assert sorted(first.losses) == [1, 2]
    out = io.StringIO()
    console = Console(file=out, width=400, highlight=False)
    again = _cfg(tmp_path, steps=2, auto_resume=True, sample_tokens=8)
    res = train(again, reporter=Reporter(again, 0, console=console))
    ckpt = tmp_path / "ckpt" / "step_00000002"
    assert out.getvalue() == (f"plait train: the run is already complete at step 2 ({ckpt}); nothing to train. To "
                              "train on, give a larger --steps (above 2) with --auto-resume.\n")
    assert res.losses == {} and res.sample is None and res.checkpoint == str(ckpt)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000002"]
