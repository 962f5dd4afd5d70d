"""--tensorboard and --wandb: each step's numbers logged (wandb offline, no network), once after a restart (a resumed
run continues its W&B run), a missing extra named."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from plait.errors import MissingExtraError
from plait.train.logs import ExperimentLogs, check_extras

ROWS = [{"step": 1, "loss": 5.5, "lr": 1e-3, "grad_norm": 2.0, "tokens_per_s": 900.0, "epoch": 0.1,
         "tokens_seen": 512, "held_out_loss": None,
         "memory": {"measured": [{"rank": 0, "params": 2**20, "grads": 2**20, "optimizer": 0, "activations_peak": 0}]}},
        {"step": 2, "loss": 5.0, "lr": 2e-3, "grad_norm": 1.5, "tokens_per_s": 950.0, "epoch": 0.2,
         "tokens_seen": 1024, "held_out_loss": 4.9}]


def test_tensorboard_and_wandb_offline_log_every_step(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    monkeypatch.setenv("WANDB_SILENT", "true")
    logs = ExperimentLogs(str(tmp_path / "tb"), "plait-test", {"seq_len": 32})
    for row in ROWS:
        logs.log(row)
    logs.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == [5.5, 5.0]
    assert [e.step for e in events.Scalars("train/held_out_loss")] == [2]
    assert events.Scalars("memory/rank0_MiB")[0].value == 2.0
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0 and "wandb sync" in logs.note


@pytest.mark.parametrize("flag,module", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_missing_extra_is_named(monkeypatch, flag, module):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    with pytest.raises(MissingExtraError, match=rf"--{flag} needs {module}.*pip install 'plait\[{flag}\]'"):
        check_extras(**{"tensorboard": None, "wandb": None, flag: "x"})


def test_a_restart_logs_each_step_once(tmp_path):
    """A run resumed at step 2 after one that logged steps 1-4 (its checkpoint was of step 2): --metrics keeps rows
    1-2 (and a --dry-run's row, and drops a line a kill cut short), TensorBoard shows steps 1-2 of the first run and
    3-4 of the second; a fresh start (--auto-resume with no checkpoint) shows only its own steps."""
    import json

    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from plait.train.logs import open_metrics

    metrics = tmp_path / "m.jsonl"
    first = [json.dumps({"step": s, "loss": float(s)}) for s in range(1, 5)]
    metrics.write_text("\n".join([json.dumps({"predicted_step_time_s": 0.1}), *first, '{"step": 5, "lo']))
    with open_metrics(metrics, 2) as f:
        f.write(json.dumps({"step": 3, "loss": 30.0}) + "\n")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r.get("step") for r in rows] == [None, 1, 2, 3] and rows[-1]["loss"] == 30.0, rows

    def logged(resumed_at: int, steps: range, base: float) -> list[tuple[int, float]]:
        logs = ExperimentLogs(str(tmp_path / "tb"), None, {}, resumed_at)
        for s in steps:
            logs.log({"step": s, "loss": base + s})
        logs.close()
        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars("train/loss")]

    assert logged(0, range(1, 5), 0.0) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert logged(2, range(3, 5), 10.0) == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]  # was 1, 2, 3, 4, 3, 4
    assert logged(0, range(1, 3), 20.0) == [(1, 21.0), (2, 22.0)]


def test_a_resumed_run_continues_its_wandb_run_and_logs_each_step_once(tmp_path, monkeypatch):
    """The first run logs steps 1-4 to a new W&B run and dies; the restart (--auto-resume, from the checkpoint of
    step 2) logs to the same run, from step 5 on (steps 3-4 of the first run stay); a fresh start (no --resume)
    opens a new run, and so does a restart with another project."""
    import json

    wandb = pytest.importorskip("wandb")
    from plait.train.logs import WANDB_RECORD

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    sent: list[tuple[str, int]] = []
    real_log = wandb.Run.log

    def log(run, values, step=None, **kw):
        sent.append((run.id, step))
        return real_log(run, values, step=step, **kw)

    monkeypatch.setattr(wandb.Run, "log", log)
    folder = tmp_path / "ckpt"

    folders: list[Path] = []  # each run's offline folder (wandb reads WANDB_DIR once a process)

    def logged(steps: range, resumed_at: int, continued: bool, project: str = "plait-test") -> tuple[str, list, str]:
        sent.clear()
        logs = ExperimentLogs(None, project, {}, resumed_at, folder, continued)
        for s in steps:
            logs.log({"step": s, "loss": float(s)})
        logs.close()
        folders.append(Path(logs.run.dir).parent)
        return logs.run.id, [step for _, step in sent], logs.note

    first, steps, note = logged(range(1, 5), 0, False)
    assert steps == [1, 2, 3, 4] and "continued" not in note
    assert json.loads((folder / WANDB_RECORD).read_text()) == {"project": "plait-test", "id": first, "step": 4}
    again, steps, note = logged(range(3, 7), 2, True)
    assert again == first and steps == [5, 6], (first, again, steps)  # was a new run, steps 3-6
    assert f"continued run {first} of project plait-test after its step 4" in note and "wandb sync" in note
    assert json.loads((folder / WANDB_RECORD).read_text())["step"] == 6
    assert [(f / f"run-{first}.wandb").is_file() for f in folders] == [True, True]  # one run, in two parts
    fresh, steps, _ = logged(range(1, 3), 0, False)
    assert fresh != first and steps == [1, 2]
    other, steps, _ = logged(range(3, 5), 2, True, "another")
    assert other not in (first, fresh) and steps == [3, 4]
    # plait train's reporter keeps the record in --checkpoint-dir and continues it under --auto-resume
    from types import SimpleNamespace

    from rich.console import Console

    from plait.parallel_config import ParallelConfig
    from plait.train.config import TrainConfig
    from plait.train.report import Reporter

    run = SimpleNamespace(pm=SimpleNamespace(family=SimpleNamespace(name="llama")), params=1e6,
                          ctx=SimpleNamespace(config=ParallelConfig()), data=SimpleNamespace(describe=lambda *_: "d"),
                          start=4, resumed_from="ck/step_4", resume_note=None, passed_over=[], resharded_from=None,
                          prediction=None, unpredicted=None)
    reporter = Reporter(TrainConfig(auto_resume=True, metrics=None, wandb="another", checkpoint_dir=str(folder)), 0,
                        Console(record=True, force_terminal=False))
    reporter.begin(run)
    assert reporter.logs is not None and reporter.logs.run.id == other
    reporter.logs.close()
