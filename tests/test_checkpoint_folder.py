"""A checkpoint folder as a user meets it: one run saving into it at a time; what --resume says of the folders it
passes over."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

import plait.train.loop as loop
from plait.checkpoint.lock import hold_folder
from plait.cli.main import app
from plait.errors import ConfigError
from plait.train import TrainConfig


def _cfg(tmp_path, name: str, **kw) -> TrainConfig:
    return TrainConfig.from_dict({**dict(
        tp=1, pp=1, dp=1, microbatches=1, seq_len=16, batch_size=2, steps=2, warmup=1, max_data_mb=0.3,
        eval_every=0, sample_tokens=0, trace_every=0, cluster="none", data=[str(tmp_path / "text")],
        checkpoint_dir=str(tmp_path / name)), **kw})


@pytest.fixture
def text(tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("some training text, repeated with a few words more. " * 60)
    return tmp_path


def test_a_second_run_saving_into_the_same_folder_is_refused_naming_the_first(text):
    """Two runs in one folder removed each other's saves in progress ('the background save of the step-7
    checkpoint failed: ... No such file or directory') or pointed 'latest' at each other's checkpoints."""
    ck = text / "ck"
    with hold_folder(ck):  # as a run in progress holds it
        with pytest.raises(ConfigError, match=rf"--checkpoint-dir {ck}: another run saves its checkpoints there "
                                              rf"\(pid {os.getpid()} on .*\); give this run another --checkpoint-dir"):
            loop.train(_cfg(text, "ck"))
        res = CliRunner().invoke(app, ["train", "--tp", "1", "--pp", "1", "--checkpoint-dir", str(ck),
                                       "--cluster", "none"])  # refused before any process starts
        assert res.exit_code == 2 and f"error: --checkpoint-dir {ck}: another run" in res.output, res.output
        assert not list(ck.glob("step_*"))
    loop.train(_cfg(text, "ck"))  # the folder is free again once that run ended
    assert (ck / "step_00000002" / "meta.json").is_file()
    with hold_folder(ck):  # and the run that ended left it free
        pass
    with hold_folder(text / "new"):  # a run that saved nothing (stopped as it started) leaves no folder behind
        assert (text / "new" / ".lock").is_file()
    assert not (text / "new").exists()


def test_a_resume_says_which_newer_checkpoints_it_passed_over_and_why(text):
    """A step_* folder without meta.json (a copy cut short), here the one 'latest' names: --resume took the newest
    complete checkpoint before it without a word; with none complete it said only 'no checkpoint'."""
    from rich.console import Console

    from plait.train.report import Reporter

    loop.train(_cfg(text, "ck", steps=4, checkpoint_every=2))
    ck = text / "ck"
    (ck / "step_00000004" / "meta.json").unlink()
    console = Console(record=True, width=400, force_terminal=False)
    cfg = _cfg(text, "ck", steps=3, resume=True)
    loop.train(cfg, reporter=Reporter(cfg, 0, console))
    out = console.export_text()
    assert (f"note: {ck}/step_00000004 has no meta.json: not a complete checkpoint (a save or a copy that did not "
            f"finish); passed over\nresuming from {ck}/step_00000002 (step 2)") in out, out
    for step in (2, 3):
        (ck / f"step_{step:08d}" / "meta.json").unlink()
    with pytest.raises(ConfigError, match=rf"--resume: no complete checkpoint in --checkpoint-dir {ck} \({ck}/"
                                          rf"step_00000002, {ck}/step_00000003, {ck}/step_00000004 have no meta.json"):
        loop.train(cfg)


def test_a_save_that_cannot_write_names_the_file_and_the_checkpoint_that_stays(text, monkeypatch):
    """A full disk during a background save ended the run with 'the background save of the step-6 checkpoint
    failed: Error while serializing: I/O error: No space left on device (os error 28)': no file, no folder, not
    whether any checkpoint was left to resume from, nor what to free; and a run resumed with a lower --keep pruned
    the checkpoints beyond it only once its save was complete, so it needed room for more than one beside them."""
    import errno

    import plait.checkpoint.writer as writer

    real = writer.fsync_path

    def full_disk(path):
        if ".step_00000002.tmp" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path)

    monkeypatch.setattr(writer, "fsync_path", full_disk)
    ck = text / "ck"
    loop.train(_cfg(text, "ck", steps=1, keep=0))
    (ck / "step_00000000").mkdir()  # an older checkpoint of the folder, beyond --keep 1
    (ck / "step_00000000" / "meta.json").write_text("{}")
    with pytest.raises(RuntimeError, match=rf"the background save of the step-2 checkpoint failed: checkpoint of step "
                                           rf"2: writing {ck}/.step_00000002.tmp/pp0-tp0-dp0.safetensors failed "
                                           rf"\(\[Errno 28\] No space left on device\); {ck}/step_00000001 stays the "
                                           rf"latest complete checkpoint; free space on the disk of {ck} \(a "
                                           r"checkpoint of this run takes \d+ MB, and a save needs room for one more "
                                           r"beside the 1 kept: --keep\), then go on from it$"):
        loop.train(_cfg(text, "ck", steps=3, checkpoint_every=1, keep=1, resume=True))
    assert not list(ck.glob(".step_00000002.tmp/*")), list(ck.glob(".step_00000002.tmp/*"))  # space given back
    # --keep 1: the save made room for one checkpoint beside the one kept, pruning the older before it wrote
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000001"], list(ck.iterdir())


def test_resume_from_one_checkpoint_or_a_hugging_face_folder_says_what_to_give(text):
    """--checkpoint-dir ck/step_00000002 --resume resumed it, then saved the run's checkpoints inside it
    (ck/step_00000002/step_00000004); a Hugging Face folder as --checkpoint-dir said 'no checkpoint' to --resume,
    and --auto-resume started fresh from random weights, saving among the model's files."""
    import json

    from plait.checkpoint.writer import FORMAT, META
    from plait.train import validate

    one = text / "ck" / "step_00000002"
    one.mkdir(parents=True)
    (one / META).write_text(json.dumps({"format": FORMAT, "step": 2}))  # what the check reads of a checkpoint
    for flag in ("resume", "auto_resume"):
        with pytest.raises(ConfigError, match=rf"--{flag.replace('_', '-')}: --checkpoint-dir {one} is one "
                                              rf"checkpoint, not a folder of them \(this run would save its own inside "
                                              rf"it\): give --checkpoint-dir {text / 'ck'} to continue its latest, or, "
                                              rf"to go on from this one, copy it into a folder of its own: mkdir new "
                                              rf"&& cp -r {one} new/ && plait train --"):
            validate(_cfg(text, str(one.relative_to(text)), steps=4, **{flag: True}))
    (text / "hf").mkdir()
    (text / "hf" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"--auto-resume: --checkpoint-dir {text / 'hf'} is a Hugging Face model "
                                          rf"folder \(config.json\), not a folder of plait checkpoints: to train from "
                                          rf"its weights give --model {text / 'hf'}"):
        validate(_cfg(text, "hf", auto_resume=True))
    validate(_cfg(text, "ck", steps=4, resume=True))  # the folder of checkpoints itself
    validate(_cfg(text, "hf"))  # a fresh run may save anywhere


def test_the_same_data_named_from_another_directory_resumes_as_the_same(text, monkeypatch):
    """A checkpoint kept --data as given (data/c): resumed from another directory as /abs/data/c, the run noted
    '--data data/c -> /abs/data/c ...: this run's batches differ' (they did not) and counted its epochs from 0."""
    import io
    import json
    import shutil

    from rich.console import Console

    from plait.train.report import Reporter

    monkeypatch.chdir(text)
    first = _cfg(text, "full", steps=3, checkpoint_every=2, data=["text"], metrics=str(text / "full.jsonl"))
    loop.train(first, reporter=Reporter(first, 0, Console(file=io.StringIO())))
    (text / "cut").mkdir()
    shutil.copytree(text / "full" / "step_00000002", text / "cut" / "step_00000002")
    monkeypatch.chdir(text / "cut")  # elsewhere: the same folder by its absolute path
    cfg = _cfg(text, "cut", steps=3, resume=True, metrics=str(text / "cut.jsonl"))
    console = Console(record=True, width=400, force_terminal=False)
    loop.train(cfg, reporter=Reporter(cfg, 0, console))
    out = console.export_text()
    assert "resuming from" in out and "--data" not in out, out
    full, cut = ([json.loads(line) for line in (text / f"{n}.jsonl").read_text().splitlines()] for n in ("full", "cut"))
    assert [(r["loss"], r["epoch"], r["tokens_seen"]) for r in cut] == [
        (r["loss"], r["epoch"], r["tokens_seen"]) for r in full[2:]], (cut, full)


def test_a_checkpoint_folder_that_cannot_be_written_is_refused_in_one_line(text, monkeypatch):
    """A read-only --checkpoint-dir ended plait train in a traceback (OSError: [Errno 30] Read-only file system)."""
    import errno

    def read_only(path, *args):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError, match=rf"--checkpoint-dir {text / 'ck'}: checkpoints cannot be written there "
                                          r"\(Read-only file system\)"):
        with hold_folder(text / "ck"):
            pass
