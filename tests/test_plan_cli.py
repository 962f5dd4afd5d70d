"""``plait plan`` / ``plait topo``: clear one-line errors, JSON output, topology from a file."""

import json

from typer.testing import CliRunner

from plait.cli.main import app

runner = CliRunner()


def test_unknown_gpu_lists_valid_names():
    r = runner.invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h1000"])
    assert r.exit_code == 2
    assert "error: gpu: unknown GPU 'h1000'" in r.output and "h100-sxm" in r.output
    assert "Traceback" not in r.output


def test_unknown_model_lists_presets():
    r = runner.invoke(app, ["plan", "--model", "gpt5", "--gpus", "8"])
    assert r.exit_code == 2 and "llama3-70b" in r.output and "Traceback" not in r.output


def test_model_that_fits_nowhere_says_what_would():
    r = runner.invoke(app, ["plan", "--model", "llama3-405b", "--gpus", "8", "--gpu", "a100-80gb"])
    assert r.exit_code == 1
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: llama3-405b on 8 × a100-80gb: no layout fits")
    assert "such GPUs" in lines[0]


def test_plan_json_and_table():
    r = runner.invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--json",
                            "--top", "3", "--seq-len", "4096", "--global-batch", "64"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert len(out["best"]) == 3 and out["best"][0]["fits"] and out["why"][0].startswith("best: ")
    r = runner.invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "8", "--show-schedule",
                            "--global-batch", "64", "--seq-len", "4096"])
    assert r.exit_code == 0 and "MFU" in r.output and "best:" in r.output


def test_plan_inference_cli():
    r = runner.invoke(app, ["plan", "--model", "llama3-70b", "--gpus", "4", "--gpu", "a100-80gb", "--inference",
                            "--batch", "8"])
    assert r.exit_code == 0, r.output
    assert "best: tp4 pp1" in r.output


TOPO = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity
GPU0     X      NV4     NV4     NV4     0-15            0
GPU1    NV4      X      NV4     NV4     0-15            0
GPU2    NV4     NV4      X      NV4     0-15            0
GPU3    NV4     NV4     NV4      X      0-15            0
"""


def test_topo_from_file(tmp_path):
    f = tmp_path / "topo.txt"
    f.write_text(TOPO)
    r = runner.invoke(app, ["topo", "--file", str(f)])
    assert r.exit_code == 0 and "tp=4" in r.output
    f.write_text("nothing here")
    r = runner.invoke(app, ["topo", "--file", str(f)])
    assert r.exit_code == 2 and "error:" in r.output
