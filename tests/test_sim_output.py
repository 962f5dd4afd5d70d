"""Simulator outputs: ASCII Gantt true to time, Chrome trace, PNG, JSON; and no torch on import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from plait.schedules import build_schedule
from plait.sim import Costs, simulate
from plait.sim.gantt import nice_step


def _chart_rows(text: str) -> list[str]:
    return [line.split("|")[1] for line in text.splitlines() if line.startswith("rank")]


def test_ascii_gantt_is_true_to_time():
    # GPipe, 2 ranks, 2 micro-batches, F=1, B=2: makespan 9 at 0.5 per column
    text = simulate(build_schedule("gpipe", 2, 2), Costs(1.0, 2.0)).to_ascii(width=20)
    assert "one column = 0.5" in text and "makespan 9" in text and "bubble 33.3%" in text
    assert _chart_rows(text) == [
        "0=1=......0###1###",
        "..0=1=0###1###....",
    ]
    assert "F forward '='" in text.splitlines()[-1]


def test_ascii_gantt_shows_p2p_gaps_and_split_backward():
    text = simulate(build_schedule("1f1b", 3, 2), Costs(1.0, 2.0, p2p=0.5)).to_ascii(width=40)
    assert _chart_rows(text)[2] == "......0=0###1=1###.........."
    zb = _chart_rows(simulate(build_schedule("zb-h1", 2, 2), Costs(1.0, 2.0, 1.0)).to_ascii(40))
    assert "+" in zb[0] and "~" in zb[0] and "#" not in zb[0]


@pytest.mark.parametrize("width", [30, 60, 100])
def test_ascii_gantt_respects_width(width):
    r = simulate(build_schedule("interleaved-1f1b", 8, 64, 4), Costs())
    rows = _chart_rows(r.to_ascii(width=width))
    assert len(rows) == 8 and all(len(row) <= width for row in rows)
    assert len(rows[0]) > width * 0.4  # and uses a fair share of it


def test_nice_step():
    assert nice_step(33, 100) == 0.5
    assert nice_step(1000, 100) == 10
    assert nice_step(1001, 100) == 20
    assert nice_step(9, 20) == 0.5


def test_rich_gantt_has_colours():
    from rich.console import Console

    r = simulate(build_schedule("zb-h1", 2, 2), Costs(1.0, 2.0, 1.0))
    console = Console(force_terminal=True, color_system="standard", width=200, record=True)
    console.print(r.to_rich(40))
    out = console.export_text(styles=True)
    assert "\x1b[" in out and "weight-grad" in out


def test_chrome_trace_is_loadable_json():
    s = build_schedule("zbv", 2, 4)
    r = simulate(s, Costs(1.0, 2.0, p2p=0.1))
    trace = json.loads(json.dumps(r.to_chrome_trace()))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == s.num_actions
    assert {e["tid"] for e in spans} == {0, 1}
    first = min(spans, key=lambda e: e["ts"])
    assert first["name"] == "0F0" and first["ts"] == 0 and first["dur"] == pytest.approx(500.0)  # 0.5 units
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1"}


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = simulate(build_schedule("1f1b", 2, 3), Costs()).to_png(tmp_path / "g.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_to_dict_figures():
    r = simulate(build_schedule("1f1b", 4, 8), Costs())
    d = json.loads(json.dumps(r.to_dict()))
    assert d["schedule"] == "1f1b" and d["makespan"] == 33.0
    assert d["peak_activations"] == [4, 3, 2, 1] and d["idle"] == [9.0] * 4
    assert d["bubble_fraction"] == pytest.approx(3 / 11) and "timeline" not in d
    full = r.to_dict(timeline=True)
    assert full["timeline"][0] == [0, "0F0", 0.0, 1.0] and len(full["timeline"]) == 64


def test_schedules_and_sim_import_no_torch():
    code = (
        "import sys, plait.schedules, plait.sim\n"
        "from plait.schedules import build_schedule\n"
        "from plait.sim import simulate\n"
        "r = simulate(build_schedule('zbv', 4, 8).validate())\n"
        "r.to_ascii(); r.to_chrome_trace(); r.to_dict()\n"
        "bad = [m for m in ('torch', 'matplotlib', 'numpy') if m in sys.modules]\n"
        "print('loaded:', bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loaded: []" in proc.stdout
