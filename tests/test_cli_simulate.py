"""``plait simulate`` through Typer's CliRunner (and one real subprocess for the exit code)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from plait.cli.main import app

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, ["simulate", *args])


def test_default_run_prints_chart_and_figures():
    res = _run("--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--width", "80")
    assert res.exit_code == 0, res.output
    out = res.output
    assert "1f1b: 4 ranks x 1 chunk, 8 micro-batches; makespan 33, bubble 27.3%" in out
    assert "rank 3 |......0=0###1=1###" in out
    assert "peak activations" in out and "makespan 33" in out


def test_figures_read_without_exponents_or_six_digits():
    res = _run("-p", "64", "-m", "512", "--forward", "10", "--backward", "20", "--compare", "gpipe,zbv")
    assert res.exit_code == 0 and "17,250" in res.output and "e+0" not in res.output, res.output  # was 1.89e+03
    res = _run("-s", "interleaved-1f1b", "-p", "4", "-m", "8", "--virtual-stages", "3", "--width", "80")
    assert res.exit_code == 0 and " 4.333 " in res.output and "4.33333" not in res.output, res.output


def test_compare_of_no_schedule_is_an_error():
    for names in (",", " "):
        res = _run("--compare", names)  # was an empty table, exit code 0
        assert res.exit_code == 2 and res.stderr.startswith(f"error: --compare {names!r}: names no schedule"), \
            res.output


def test_json_output():
    res = _run("-s", "zb-h1", "-p", "4", "-m", "8", "--weight", "1", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["schedule"] == "zb-h1" and data["peak_activations"] == [4, 4, 4, 4]
    assert data["makespan"] == 27.0 and data["costs"]["weight"] == 1.0


def test_compare_table():
    res = _run("-p", "4", "-m", "8", "--weight", "1", "--compare", "gpipe,1f1b,interleaved-1f1b,zb-h1,zbv,dualpipev")
    assert res.exit_code == 0, res.output
    lines = {line.split()[1]: line for line in res.output.splitlines() if line.startswith("│")}
    assert "27.3%" in lines["gpipe"] and "27.3%" in lines["1f1b"]
    assert "11.1%" in lines["zb-h1"] and "5.9%" in lines["zbv"]


def test_compare_marks_inapplicable_schedules():
    res = _run("-p", "4", "-m", "4", "--compare", "1f1b,dualpipev")
    assert res.exit_code == 0, res.output
    assert "n/a" in res.output


def test_exports_and_csv_import(tmp_path):
    csv_path, trace, png = tmp_path / "s.csv", tmp_path / "t.json", tmp_path / "g.png"
    res = _run("-s", "interleaved-1f1b", "-p", "2", "-m", "4", "-v", "2", "--csv", str(csv_path),
               "--trace", str(trace), "--png", str(png))
    assert res.exit_code == 0, res.output
    assert csv_path.read_text().startswith("0F0,0F1,2F0")
    assert json.loads(trace.read_text())["traceEvents"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    back = _run("--from-csv", str(csv_path), "--json")
    assert back.exit_code == 0, back.output
    assert json.loads(back.output)["num_stages"] == 4


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--microbatches", "0"], "error: --microbatches 0: must be an integer >= 1"),
        (["-p", "0"], "error: --stages 0: must be an integer >= 1"),
        (["--schedule", "nope"], "error: --schedule 'nope': unknown; valid names are gpipe"),
        (["-s", "zbv", "--virtual", "3"], "error: --virtual-stages 3: zbv places exactly 2 chunk(s) per rank; use 2"),
        (["-s", "dualpipev", "-p", "4", "-m", "3"], "error: --microbatches 3: dualpipev needs at least 2 per "
                                                    "pipeline stage, 8 for 4 stages"),
        (["--rounds", "padded"], "error: --rounds 'padded': only interleaved-1f1b and zb-h1"),
        (["-s", "zb-h1", "--weight", "5"], "error: --weight 5.0: the weight-gradient part"),
        (["--weight", "0.5"], "error: --weight 0.5: 1f1b runs each backward whole (B)"),  # was silently ignored
        (["--compare", "gpipe,1f1b", "--weight", "0.5"], "error: --weight 0.5: none of --compare gpipe,1f1b splits"),
        (["--json", "--actions", "--width", "30"], "error: --actions, --width 30: not with --json"),
        (["--csv", "/proc/x.csv"], "error: --csv /proc/x.csv: cannot write it ("),  # was [Errno 2] ..., no flag
        (["--p2p", "-1"], "error: --p2p -1.0: must be a finite number >= 0"),
        (["--compare", "1f1b,nope"], "error: --compare 1f1b,nope: unknown schedule 'nope'; valid names are gpipe"),
        (["--compare", "gpipe,1f1b,gpipe"], "error: --compare gpipe,1f1b,gpipe: gpipe listed more than once"),
        (["--compare", "zbv,1F1B,1f1b,zbv"], "error: --compare zbv,1F1B,1f1b,zbv: 1f1b, zbv listed more than once"),
        # options the mode would not read are named, not silently ignored
        (["--compare", "1f1b,zbv", "--png", "x.png", "--actions"], "error: --png x.png, --actions: not with --compare"),
        (["--compare", "1f1b,zbv", "-s", "zbv"], "error: --schedule zbv: not with --compare"),
        (["--from-csv", "README.md", "-s", "gpipe", "-p", "8"], "error: --schedule gpipe, --stages 8: not with "
                                                                 "--from-csv, whose file sets the schedule"),
        (["--from-csv", "README.md", "--virtual", "2"], "error: --virtual: not with --from-csv"),
        (["--width", "0"], "error: --width 0: must be >= 1 column"),
        (["--from-csv", "/nonexistent/x.csv"], "error: --from-csv /nonexistent/x.csv: no such file"),
        (["--trace", "/"], "error: --trace /: a folder, not a file"),
        (["--png", "/dev/null/x.png"], "error: --png /dev/null/x.png: /dev/null is a file"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, needle):
    res = _run(*args)
    assert res.exit_code == 2
    assert needle in res.stderr
    assert "Traceback" not in res.output + res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_help_teaches():
    res = _run("--help")
    assert res.exit_code == 0
    for word in ("interleaved-1f1b", "zb-h1", "dualpipev", "bubble", "Peak activations", "--compare"):
        assert word in res.output


def test_real_process_exit_code():
    proc = subprocess.run([sys.executable, "-m", "plait.cli.main", "simulate", "-m", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --microbatches 0: must be an integer >= 1"


def test_compare_json():
    res = _run("-p", "4", "-m", "4", "--compare", "1f1b,zbv,dualpipev", "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert [r["schedule"] for r in rows] == ["1f1b", "zbv", "dualpipev"]
    assert rows[0]["bubble_fraction"] == pytest.approx(3 / 7)
    assert rows[2]["error"].startswith("--microbatches 4: dualpipev needs at least 2 per pipeline stage, 8 for 4")


def test_output_files_get_their_folders(tmp_path):
    """As every command's output (--out, --metrics, --checkpoint-dir, --write-config): missing folders are made."""
    res = _run("-s", "zbv", "--csv", str(tmp_path / "new" / "zbv.csv"), "--trace", str(tmp_path / "t" / "zbv.json"),
               "--png", str(tmp_path / "p" / "q" / "zbv.png"))
    assert res.exit_code == 0 and (tmp_path / "new" / "zbv.csv").is_file() and (tmp_path / "t" / "zbv.json").is_file()
    assert f"wrote {tmp_path / 'p' / 'q' / 'zbv.png'}" in res.output
    out = tmp_path / "plans" / "new" / "run.toml"
    res = runner.invoke(app, ["plan", "--model", "tiny", "--gpus", "4", "--gpu", "cpu", "--gpus-per-node", "4",
                               "--write-config", str(out)])
    assert res.exit_code == 0 and out.is_file(), res.output
