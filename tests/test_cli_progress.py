"""plait train, generate, serve and verify say at once that they are starting, before they import torch (5-7 s of
silence on an idle host, a minute on a loaded one), when a person watches (standard error is a terminal); piped,
they print only what they printed before. ``plait --help`` and ``plait train --help`` import no torch."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import threading

import pytest

PLAIT = [sys.executable, "-X", "importtime", "-m", "plait.cli.main"]
# -X importtime's first line of torch or one of its modules (each line is written once that module is loaded)
TORCH = re.compile(r"^import time:.*\|\s+torch(\.\w+)*$", re.M)


def _run_on_a_terminal(args: list[str]) -> tuple[int, str]:
    """Run ``plait ARGS`` with its standard error on a pseudo-terminal: (exit code, what it wrote there)."""
    main, side = pty.openpty()
    proc = subprocess.Popen(PLAIT + args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=side,
                            env={**os.environ, "PLAIT_TIMEOUT": "30"})
    os.close(side)
    chunks: list[bytes] = []

    def drain() -> None:  # until the command and its children close the terminal (EIO)
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    code = proc.wait(timeout=240)
    reader.join(timeout=60)
    os.close(main)
    return code, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


@pytest.mark.parametrize("args,line", [
    (["train", "--seq-len", "1024"], "plait train: starting 4 processes (tp 2 x pp 2 x dp 1) ..."),
    (["generate", "--pp", "2", "--top-k", "3"], "plait generate: starting 2 processes (tp 1 x pp 2) ..."),
    (["verify", "--tp", "2", "--pp", "1", "--dp", "1", "--layers", "0"],
     "plait verify: starting 2 processes (tp 2 x pp 1 x dp 1) ..."),
])
def test_the_first_line_comes_before_torch_is_imported(args, line):
    """Each command here fails its checks (after importing torch): what matters is what came first."""
    code, err = _run_on_a_terminal(args)
    assert code == 2, err[-3000:]
    first_torch = TORCH.search(err)
    assert first_torch is not None, err[-3000:]  # the command did import torch: the line had something to precede
    assert line in err[:first_torch.start()], err[:first_torch.start()][-2000:]


def test_piped_the_commands_print_no_progress_line():
    proc = subprocess.run([sys.executable, "-m", "plait.cli.main", "train", "--seq-len", "1024"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --seq-len 1024"), proc.stderr


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"]])
def test_help_imports_no_torch(args):
    code = ("import sys; sys.argv = ['plait', *sys.argv[1:]]\n"
            "from plait.cli.main import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "sys.stderr.write(repr(sorted(m for m in ('torch', 'numpy') if m in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert "Usage:" in proc.stdout and proc.stderr == "[]", proc.stderr


def test_generate_and_serve_say_which_weights_they_read_and_how_many_bytes(tmp_path, monkeypatch):
    """Reading a large model's weights is the longest silence of a start (19 s for 406 MB here, after the starting
    line): on a terminal, generate and serve say from where and how much, once their checks have passed. A
    checkpoint's bytes are its model tensors' (the optimizer state is not read)."""
    import io
    import json

    from typer.testing import CliRunner

    import plait.cli.progress as progress
    import plait.distributed.launch as launch
    from plait.checkpoint.store import FORMAT, META
    from plait.cli.main import app
    from plait.generation.job import weights_size
    from serve_util import listen_port, tiny_model

    model = str(tiny_model(tmp_path / "m"))
    size = (tmp_path / "m" / "model.safetensors").stat().st_size
    assert weights_size(model) == (model, size)
    step = tmp_path / "ck" / "step_00000001"
    step.mkdir(parents=True)
    tensor = {"w": {"shape": [4, 8], "dtype": "float32"}, "n": {"shape": [3], "dtype": "bfloat16"},
              "optim/exp_avg/w": {"shape": [4, 8], "dtype": "float32"}}
    (step / META).write_text(json.dumps({"format": FORMAT, "tensors": tensor}))
    assert weights_size(str(tmp_path / "ck")) == (str(step), 4 * 8 * 4 + 3 * 2)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    said = Terminal()
    monkeypatch.setattr(progress.sys, "stderr", said)
    progress.loading("generate", "big", 405_868_544)
    assert said.getvalue() == "plait generate: reading the weights of big (406 MB) ...\n"
    calls = []
    monkeypatch.setattr(progress, "loading", lambda *args: calls.append(args))
    monkeypatch.setattr(launch, "run_or_launch", lambda *args, **kwargs: calls.append("launched"))
    for args in (["generate", "--model", model, "--prompt", "hi"],
                 ["serve", "--model", model, "--port", str(listen_port())]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        assert calls == [(args[0], model, size), "launched"], calls  # said before the launch, not after
        calls.clear()


def test_train_says_which_weights_or_checkpoint_it_reads(tmp_path, monkeypatch):
    """plait train from a Hugging Face folder says its weights' bytes before the launch; a resumed run, the
    checkpoint's (weights and optimizer state: 1,218 MB for a 101M-parameter model, read in silence)."""
    from contextlib import nullcontext

    from typer.testing import CliRunner

    import plait.cli.progress as progress
    import plait.distributed.fork_server as fork_server
    import plait.distributed.launch as launch
    from plait.cli.main import app
    from plait.cli.train import _say_loading
    from plait.train.config import TrainConfig
    from serve_util import tiny_model

    model = str(tiny_model(tmp_path / "m"))
    calls = []
    monkeypatch.setattr(progress, "loading", lambda *args: calls.append(args))
    monkeypatch.setattr(fork_server, "ahead", lambda *args, **kwargs: nullcontext())
    monkeypatch.setattr(launch, "launch", lambda *args, **kwargs: calls.append("launched"))
    res = CliRunner().invoke(app, ["train", "--model", model, "--tp", "1", "--pp", "1", "--cluster", "none",
                                   "--checkpoint-dir", str(tmp_path / "ck")])
    assert res.exit_code == 0, res.output
    assert calls == [("train", model, (tmp_path / "m" / "model.safetensors").stat().st_size), "launched"], calls
    calls.clear()
    step = tmp_path / "ck" / "step_00000004"
    step.mkdir(parents=True)
    for name, size in (("pp0-tp0-dp0.safetensors", 700), ("pp1-tp0-dp0.safetensors", 500), ("meta.json", 90)):
        (step / name).write_bytes(b"x" * size)
    _say_loading(TrainConfig(model=model), (step, 4))
    assert calls == [("train", str(step), 1200, "the weights and optimizer state of")], calls
