"""plait train/generate/export as a user runs them: bad flags, a short real run, a killed worker, a killed save."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from harness import alive
from plait.cli.main import app
from plait.distributed.launch import worker_pids
from save_util import assert_first_checkpoint_whole, kill_inside_second_save

PLAIT = [sys.executable, "-m", "plait.cli.main"]
FAST = ["--seq-len", "32", "--batch-size", "4", "--microbatches", "2", "--eval-every", "0", "--max-data-mb", "0.3",
        "--trace-every", "2"]


@pytest.mark.parametrize("args,needle", [
    (["--model", "gigantic"], "--model 'gigantic'"),
    (["--data", "/no/such/path"], "--data /no/such/path: no such file"),
    (["--tp", "3", "--pp", "2", "--nproc", "4"], "the world has 4"),
    (["--tp", "3", "--pp", "1"], "--tp 3 does not fit"),
    (["--schedule", "zigzag"], "--schedule 'zigzag'"),
    (["--seq-len", "1024", "--cp", "2", "--dp", "1", "--tp", "1", "--pp", "1", "--dry-run"],  # no way on was named
     "error: --seq-len 1024 exceeds the model's max_seq_len 512 (--model tiny): valid --seq-len 1 to 512; the presets' "
     "contexts are tiny 512, small 1024, a --model folder's config.json sets its own (max_position_embeddings)"),
    (["--batch-size", "6"], "--batch-size 6 must be a multiple of --dp x --microbatches = 1 x 4 = 4 (each "
                            "replica's sequences cut into equal micro-batches): valid --batch-size 4, 8, 12, ...; or "
                            "--microbatches 1, 2, 3 or 6, which divide a replica's 6 sequences"),  # named no choice
    (["--batch-size", "2", "--dp", "2", "--tp", "1", "--pp", "2", "--microbatches", "2", "--dry-run"],
     "--dp x --microbatches = 2 x 2 = 4 (each replica's sequences cut into equal micro-batches): valid --batch-size "
     "4, 8, 12, ...; or --microbatches 1, which divides a replica's 1 sequence"),
    (["--steps", "0"], "error: --steps 0: must be a positive integer"),  # as every other flag: --flag value
    (["--seq-len", "0"], "error: --seq-len 0: must be a positive integer"),
    (["--microbatches", "0"], "error: --microbatches 0: must be a positive integer (or left unset: the default)"),
    (["--nproc", "0", "--dry-run"], "error: --nproc 0: must be a positive integer"),
    (["--nproc", "0", "--layout", "auto", "--dry-run"], "error: --nproc 0: must be a positive integer"),
    (["--layout", "auto", "--nproc", "2", "--dry-run", "--cluster", "none"],  # was: the search, then this
     "error: --dry-run: it prints the prediction, and --cluster none turns that off"),
    (["--pp", "2", "--zero", "3"], "error: --zero 3: not with a pipeline (--pp 2)"),
    (["--layout", "auto", "--nproc", "2", "--tp", "2", "--schedule", "zbv", "--dry-run"],  # not silently replaced
     "error: --tp, --schedule: --layout auto chooses the whole layout (all but --precision); drop them"),
    (["--warmup", "-1", "--dry-run"], "--warmup -1: must be >= 0"),
    (["--clip", "-1", "--dry-run"], "--clip -1.0: must be >= 0"),
    (["--weight-decay", "-0.1", "--dry-run"], "--weight-decay -0.1: must be >= 0"),
    (["--sample-tokens", "-1", "--dry-run"], "--sample-tokens -1: must be >= 0"),
    (["--eval-every", "-5", "--dry-run"], "--eval-every -5: must be >= 0"),
    (["--max-data-mb", "0", "--dry-run"], "--max-data-mb 0.0: must be > 0"),
    (["--resume", "--checkpoint-dir", "/no/such/ckpts", "--dry-run"], "--resume: no checkpoint in --checkpoint-dir"),
    (["--resume", "--auto-resume", "--dry-run"], "error: --resume, --auto-resume: choose one"),  # --resume won
    (["--cp-comm", "ring", "--dry-run"], "error: --cp-comm ring: how context-parallel ranks exchange keys and "
                                         "values, but --cp is 1"),  # was silently ignored
    (["--experts", "6", "--ep", "4", "--dp", "4", "--tp", "1", "--pp", "1", "--nproc", "4", "--dry-run"],
     "error: --ep 4: must divide --experts 6: each EP rank holds an equal share of the experts; valid: [1, 2, 3, 6]"),
    (["--experts", "4", "--ep", "4", "--dp", "2", "--tp", "2", "--pp", "1", "--nproc", "4", "--expert-tp",
      "--dry-run"], "error: --ep 4: must divide --dp 2 with --expert-tp (every TP rank holds a shard"),
])
def test_bad_flags_fail_with_one_line(args, needle):
    res = CliRunner().invoke(app, ["train", *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert needle in lines[0] and "Traceback" not in res.output


def test_a_model_folder_without_weights_is_refused_naming_what_is_missing(tmp_path):
    """A folder of only config.json and tokenizer files: --model DIR starts from the folder's weights."""
    from plait.model_presets import PRESETS
    from plait.models import Llama, LlamaConfig

    folder = tmp_path / "m"
    Llama(LlamaConfig(**PRESETS["tiny"])).save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    (folder / "tokenizer_config.json").write_text("{}")
    res = CliRunner().invoke(app, ["train", "--model", str(folder), "--tp", "1", "--pp", "1", "--dry-run"])
    assert res.exit_code == 2, res.output
    assert res.output == (f"error: --model {folder}: no weights in the folder (it holds config.json, "
                          "tokenizer_config.json): a model folder starts from its *.safetensors files, or "
                          "model.safetensors.index.json and its shards; pickled .bin weights are not read. Add the "
                          "weights (`plait export CHECKPOINT DIR` writes a whole folder), or start a fresh model "
                          "from a preset (plait train --model tiny or small)\n")


@pytest.mark.parametrize("damage", ["cut short", "shard missing", "index damaged"])
def test_a_model_folder_with_a_damaged_weights_file_is_one_error_naming_the_file(tmp_path, damage):
    """A copy or download that stopped: the safetensors file cut short, a shard the index lists gone, an index
    without its weight_map. Each was a traceback (SafetensorError, FileNotFoundError, KeyError)."""
    from safetensors.torch import save_file

    from plait.model_presets import PRESETS
    from plait.models import Llama, LlamaConfig

    folder = tmp_path / "m"
    Llama(LlamaConfig(**PRESETS["tiny"])).save_pretrained(folder)
    weights = folder / "model.safetensors"
    if damage == "cut short":
        weights.write_bytes(weights.read_bytes()[:-5000])
        needle = "model.safetensors cannot be read ("
    else:
        from safetensors.torch import load_file

        state = load_file(weights)
        weights.unlink()
        names = sorted(state)
        half = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
                "model-00002-of-00002.safetensors": names[len(names) // 2:]}
        for file, keys in half.items():
            save_file({k: state[k] for k in keys}, folder / file)
        index = {"weight_map": {k: file for file, keys in half.items() for k in keys}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index if damage == "shard missing" else {}))
        if damage == "shard missing":
            (folder / "model-00002-of-00002.safetensors").unlink()
        needle = {"shard missing": "model-00002-of-00002.safetensors is missing, though model.safetensors.index.json "
                                   "lists it",
                  "index damaged": "model.safetensors.index.json is damaged (no JSON weight_map"}[damage]
    res = CliRunner().invoke(app, ["train", "--model", str(folder), "--tp", "1", "--pp", "1", "--dry-run"])
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: --model {folder}: {needle}") and len(res.output.splitlines()) == 1, \
        res.output


def test_resume_with_another_model_says_what_differs_before_launching(tmp_path):
    from plait.checkpoint.store import FORMAT, META
    from plait.train.config import TrainConfig, model_config

    saved = json.loads(json.dumps(model_config(TrainConfig()).to_dict()))  # the tiny preset, as a save writes it
    done = tmp_path / "ckpt" / "step_00000005"
    done.mkdir(parents=True)
    (done / META).write_text(json.dumps({"format": FORMAT, "step": 5, "model": saved, "train": {"model": "tiny"}}))
    res = CliRunner().invoke(app, ["train", "--resume", "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "9",
                                   "--model", "small", "--dry-run"])
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: --resume: {done} holds another model than --model small (dim 128 -> 256"), \
        res.output
    assert "(--model tiny)" in res.output
    res = CliRunner().invoke(app, ["train", "--auto-resume", "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps",
                                   "9", "--experts", "2", "--dry-run"])
    assert res.exit_code == 2 and res.output.startswith(f"error: --auto-resume: {done} holds another model than "
                                                        "--model tiny (n_experts 1 -> 2"), res.output


def test_a_damaged_checkpoint_is_a_config_error_naming_the_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    from plait.checkpoint import CheckpointReader
    from plait.checkpoint.store import FORMAT, META
    from plait.errors import ConfigError

    meta = {"format": FORMAT, "step": 1, "tensors": {"w": {"shape": [2], "dtype": "float32", "shards": [
        {"file": "pp0-tp0-dp0.safetensors", "dim": None, "start": 0, "stop": 2}]}}}
    (tmp_path / META).write_text(json.dumps(meta))
    shard = tmp_path / "pp0-tp0-dp0.safetensors"
    save_file({"w": torch.ones(2)}, str(shard))
    assert CheckpointReader(tmp_path).read("w").tolist() == [1.0, 1.0]
    shard.unlink()
    with pytest.raises(ConfigError, match="pp0-tp0-dp0.safetensors is missing, though meta.json lists it"):
        CheckpointReader(tmp_path).read("w")
    shard.write_text("junk")
    with pytest.raises(ConfigError, match="pp0-tp0-dp0.safetensors cannot be read .*the checkpoint is damaged"):
        CheckpointReader(tmp_path).read("w")
    (tmp_path / META).write_text("{")
    with pytest.raises(ConfigError, match="meta.json is not valid JSON"):
        CheckpointReader(tmp_path)


def test_output_paths_that_cannot_be_made_fail_before_launching(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    for args, needle in ((["--checkpoint-dir", "a-file"], "error: --checkpoint-dir a-file: a file, not a folder"),
                         (["--metrics", "a-file/m.jsonl"], f"error: --metrics a-file/m.jsonl: {tmp_path / 'a-file'} "
                                                           "is a file"),
                         (["--metrics", "."], "error: --metrics .: a folder, not a file")):
        res = CliRunner().invoke(app, ["train", "--dry-run", *args])
        assert res.exit_code == 2 and res.output.startswith(needle), (args, res.output)


def test_ep_not_dividing_a_mixtral_folder_s_experts_names_the_model_not_experts_flag(tmp_path):
    """No --experts was typed (a folder brings its own): the refusal names --model and its number of experts."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 32, "vocab_size": 300, "num_hidden_layers": 1,
        "num_attention_heads": 4, "intermediate_size": 48, "num_local_experts": 6, "num_experts_per_tok": 2}))
    res = CliRunner().invoke(app, ["train", "--model", str(tmp_path), "--ep", "4", "--dp", "4", "--tp", "1", "--pp",
                                   "1", "--nproc", "4", "--dry-run"])
    assert res.exit_code == 2 and res.output == (f"error: --ep 4: must divide the 6 experts of --model {tmp_path}; "
                                                 "valid: [1, 2, 3, 6]\n"), res.output


def test_a_model_folder_with_a_broken_config_json_is_one_error_line(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{")
    for command in (["train", "--dry-run"], ["generate"], ["serve"]):
        res = CliRunner().invoke(app, [*command, "--model", str(tmp_path / "m")])
        assert res.exit_code == 2, (command, res.output)
        assert res.output.startswith(f"error: --model {tmp_path / 'm'}: {tmp_path / 'm' / 'config.json'} is not "
                                     "valid JSON ("), (command, res.output)


def test_generate_bad_flags_fail_before_launching(tmp_path):
    from serve_util import tiny_model

    model = str(tiny_model(tmp_path / "m"))
    for args, needle in ((["--temperature", "-1"], "error: --temperature -1.0: must be >= 0"),
                         (["--max-new-tokens", "-5"], "error: --max-new-tokens -5: must be >= 0"),
                         (["--tp", "3"], "error: --tp 3 does not fit --model"),
                         (["--pp", "8"], "error: --pp 8: --model"),
                         (["--prompt", ""], "error: --prompt '': no tokens"),  # was unnamed, from the decoder
                         (["--top-k", "5"], "error: --top-k 5: greedy decoding (--temperature 0, the default) always "
                                            "takes the most likely token, so it has no effect"),  # were ignored
                         (["--seed", "0", "--top-k", "3"], "error: --top-k 3, --seed 0: greedy decoding"),
                         (["--max-new-tokens", "1000"], "error: --max-new-tokens 1000: --prompt 'hi' is 2 tokens, "
                                                        "and 2 + 1000 exceeds the model's 128 positions; give at "
                                                        "most --max-new-tokens 126")):  # named no flag, launched
        res = CliRunner().invoke(app, ["generate", "--model", model, "--prompt", "hi", *args])
        assert res.exit_code == 2 and res.output.startswith(needle), (args, res.output)


def test_config_file_keys_match_flags(tmp_path):
    from plait.train.config import read_toml

    f = tmp_path / "run.toml"
    f.write_text('tp = 1\npp = 4\nseq-len = 64\ndata = ["a.txt"]\n')
    assert read_toml(f) == {"tp": 1, "pp": 4, "seq_len": 64, "data": ["a.txt"]}
    f.write_text("warp = 9\n")
    res = CliRunner().invoke(app, ["train", "--config", str(f)])
    assert res.exit_code == 2 and "unknown key 'warp'" in res.output


@pytest.mark.parametrize("line,needle", [
    ('lr = "fast"', "lr = 'fast': must be a number"),
    ('warmup = "a"', "warmup = 'a': must be an integer"),
    ("model = 5", "model = 5: must be a string"),
    ("data = 5", "data = 5: must be a string or a list of strings"),
    ('resume = "yes"', "resume = 'yes': must be true or false"),
])
def test_config_file_value_of_the_wrong_type_is_one_error_line(tmp_path, line, needle):
    f = tmp_path / "run.toml"
    f.write_text(line + "\n")
    res = CliRunner().invoke(app, ["train", "--config", str(f), "--dry-run"])
    assert res.exit_code == 2 and res.output.strip() == f"error: --config {f}: {needle}", res.output


def test_config_file_number_settings_take_integers(tmp_path):
    from plait.train.config import read_toml

    f = tmp_path / "run.toml"
    f.write_text('lr = 1\nclip = 0\ndata = "a.txt"\n')
    assert read_toml(f) == {"lr": 1.0, "clip": 0.0, "data": ["a.txt"]}


def test_a_flag_on_by_default_can_be_turned_off(tmp_path):
    """A boolean option is a pair (--async-checkpoint / --no-async-checkpoint): the run's summary names the
    off switch, so it must parse; the config file's value is overridden by it."""
    import typer

    from plait.cli import train as cli_train

    seen = {}
    params = {p.name: p for p in typer.main.get_command(app).commands["train"].params}
    assert params["async_checkpoint"].secondary_opts == ["--no-async-checkpoint"]
    f = tmp_path / "run.toml"
    f.write_text("async-checkpoint = true\n")
    real = cli_train._run
    try:
        cli_train._run = lambda cfg: seen.update(cfg=cfg)
        res = CliRunner().invoke(app, ["train", "--config", str(f), "--no-async-checkpoint", "--sequence-parallel"])
    finally:
        cli_train._run = real
    assert res.exit_code == 0, res.output
    assert seen["cfg"].async_checkpoint is False and seen["cfg"].parallel.sequence_parallel is True


def _run(args, cwd, timeout=240):
    return subprocess.run(PLAIT + args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_short_run_metrics_checkpoint_sample_generate_export(tmp_path, monkeypatch):
    tensorboard = ["--tensorboard", "tb"] if importlib.util.find_spec("tensorboard") else []
    res = _run(["train", "--steps", "4", *FAST, "--sample-tokens", "8", "--metrics", "m.jsonl", *tensorboard], tmp_path)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(ln) for ln in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["tokens_seen"] for r in rows] == [128, 256, 384, 512] and 0 < rows[0]["epoch"] < rows[-1]["epoch"] < 1
    assert not tensorboard or list((tmp_path / "tb").glob("events.out.tfevents.*")), "no TensorBoard events"
    assert all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in rows)
    assert "measured_bubble" in rows[1] and 0 <= rows[1]["predicted_bubble"] < 1
    assert "summary" in res.stdout and "sample" in res.stdout and "step_00000004" in res.stdout
    assert (tmp_path / "plait-checkpoints" / "step_00000004" / "pp1-tp1-dp0.safetensors").is_file()
    gen = _run(["generate", "--prompt", "def ", "--max-new-tokens", "5"], tmp_path)
    assert gen.returncode == 0 and gen.stdout.startswith("def "), gen.stderr
    exp = _run(["export", "plait-checkpoints", "hf"], tmp_path)
    assert exp.returncode == 0 and (tmp_path / "hf" / "config.json").is_file(), exp.stderr
    (tmp_path / "a-file").write_text("")
    monkeypatch.chdir(tmp_path)  # the refusal comes before any work: in this process (a real run's exit code above)
    refused = CliRunner().invoke(app, ["export", "plait-checkpoints", "a-file"])
    assert refused.exit_code == 2 and refused.stderr.strip() == "error: OUT a-file: cannot write a folder there " \
        "(File exists: a-file)", refused.output


def _wait_for_rows(metrics: Path, n: int, timeout: float) -> None:
    """Until the run's metrics file has ``n`` rows (steps), at most ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < n):
        time.sleep(0.05)


def test_killed_worker_ends_the_job_promptly(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(PLAIT + ["train", "--steps", "100000", *FAST, "--metrics", str(metrics)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_rows(metrics, 2, 120)
        workers = worker_pids(proc.pid)
        assert len(workers) == 4, f"expected 4 workers, found {workers}"
        victim = sorted(workers)[2]
        os.kill(victim, signal.SIGKILL)
        t0 = time.time()
        _, err = proc.communicate(timeout=60)
        elapsed = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.0f}s to end"
    assert f"(pid {victim}) died (signal SIGKILL)" in err and "Traceback" not in err, err
    deadline = time.monotonic() + 1  # every worker gone within a second of the job's end
    while [p for p in workers if alive(p)] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [p for p in workers if alive(p)], "orphan workers left behind"


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    kill_inside_second_save("""
        writer.save_checkpoint(pm, None, sys.argv[1], 1)
        with torch.no_grad():
            for p in pm.parameters():
                p.add_(1.0)
        hang_in_writes()
        writer.save_checkpoint(pm, None, sys.argv[1], 2)
    """, tmp_path / "ck", {"writing"})  # inside the second save, after its first write
    assert_first_checkpoint_whole(tmp_path / "ck")


def test_sigterm_saves_a_checkpoint_and_resume_continues(tmp_path):
    """SIGTERM to plait train (as SLURM or Kubernetes send it): every worker stops after the same step with a
    checkpoint, exit code 0 within a bounded time; --resume then continues to the same losses as one device."""
    from checks_train import reference_losses
    from plait.train import TrainConfig

    steps = 12
    flags = ["--tp", "1", "--pp", "2", "--steps", str(steps), "--seq-len", "32", "--batch-size", "4",
             "--microbatches", "2", "--max-data-mb", "0.3", "--sample-tokens", "0"]
    metrics = tmp_path / "m.jsonl"
    slow = ["--eval-every", "1", "--trace-every", "1"]  # longer steps, same losses: the signal lands mid-run
    proc = subprocess.Popen(PLAIT + ["train", *flags, *slow, "--metrics", str(metrics)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_rows(metrics, 2, 150)
        proc.send_signal(signal.SIGTERM)
        t0 = time.time()
        out, err = proc.communicate(timeout=120)
        elapsed = time.time() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert elapsed < 60, f"the run took {elapsed:.0f}s to stop"  # one step, one checkpoint, teardown
    first = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    stopped = first[-1]["step"]
    assert 2 <= stopped < steps, f"stopped at {stopped}: the signal did not arrive mid-run"
    assert f"stopped by SIGTERM after step {stopped}" in " ".join(out.split()), out
    assert (tmp_path / "plait-checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    res = _run(["train", *flags, "--eval-every", "0", "--resume", "--metrics", str(tmp_path / "m2.jsonl")], tmp_path)
    assert res.returncode == 0, res.stderr
    second = [json.loads(ln) for ln in (tmp_path / "m2.jsonl").read_text().splitlines()]
    assert [r["step"] for r in first + second] == list(range(1, steps + 1))
    cfg = TrainConfig.from_dict(dict(tp=1, pp=2, steps=steps, seq_len=32, batch_size=4, microbatches=2,
                                     max_data_mb=0.3))
    ref = reference_losses(cfg, steps)
    for r in first + second:
        assert abs(r["loss"] - ref[r["step"] - 1]) <= 1e-5 * ref[r["step"] - 1], (r, ref)


def test_a_torchrun_worker_that_lost_its_peer_says_so_in_one_error_not_a_traceback(monkeypatch):
    """Under torchrun a rank whose peer died ended in a Python traceback of ~60 lines (torchrun prints it, each
    line prefixed [rank0]:) with the message at its foot; it now ends as under plait's own launcher."""
    import plait.cli.train_worker as train_worker
    from plait.errors import CommError

    def lost(payload):
        raise CommError("pipeline rank 0 failed in action 0B1 (#3); it needs the gradient from global rank 1")

    monkeypatch.setattr(train_worker, "train_worker", lost)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("PLAIT_DEBUG", raising=False)
    res = CliRunner().invoke(app, ["train", "--tp", "1", "--pp", "2"])
    assert res.exit_code == 1, (res.output, res.exception)
    assert res.output == ("error: rank 0: CommError: pipeline rank 0 failed in action 0B1 (#3); it needs the "
                          "gradient from global rank 1\n"), res.output
    monkeypatch.setenv("PLAIT_DEBUG", "1")  # the traceback, for whoever asks
    assert isinstance(CliRunner().invoke(app, ["train", "--tp", "1", "--pp", "2"]).exception, CommError)
