"""PyTorch pipelining CSV export/import (compute-only format: one row per rank, cells like ``0F0``)."""

from __future__ import annotations

import csv

import pytest

from plait.errors import ConfigError
from plait.schedules import SCHEDULE_NAMES, Schedule, build_schedule


def _write_like_torch(path, pipeline_order):
    """What ``PipelineScheduleMulti._dump_csv`` does: csv.writer over each rank's list, None -> ''."""
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        for rank in pipeline_order:
            writer.writerow(pipeline_order[rank])


def test_read_a_torch_written_file_with_idle_cells(tmp_path):
    # 1F1B on 2 ranks x 3 micro-batches as torch lays it out, with None (idle) steps
    order = {
        0: ["0F0", "0F1", None, "0B0", "0F2", "0B1", None, "0B2"],
        1: [None, "1F0", "1B0", "1F1", "1B1", "1F2", "1B2", None],
    }
    path = tmp_path / "torch.csv"
    _write_like_torch(path, order)
    assert path.read_text().splitlines()[1] == ",1F0,1B0,1F1,1B1,1F2,1B2,"
    s = Schedule.from_csv(path)
    assert (s.num_ranks, s.num_stages, s.virtual, s.microbatches) == (2, 2, 1, 3)
    assert [str(a) for a in s.actions[0]] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]
    assert s.placement == (0, 1)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_csv_round_trip(tmp_path, name):
    s = build_schedule(name, 4, 8)
    path = tmp_path / f"{name}.csv"
    text = s.to_csv(path)
    with open(path, newline="") as fh:
        assert fh.read() == text  # csv.writer's \r\n line ends, as torch writes them
    assert text.splitlines()[0].split(",")[0] == "0F0"
    back = Schedule.from_csv(path, name=name)
    assert back.actions == s.actions
    assert back.placement == s.placement and back.virtual == s.virtual and back.microbatches == 8
    assert Schedule.from_csv(text).actions == s.actions  # CSV text works too


def test_overlapped_pairs_are_read_as_two_actions():
    # torch's DualPipeV writes each overlapped forward/backward pair as one OVERLAP_F_B cell
    s = build_schedule("dualpipev", 2, 4)
    rows = []
    for row in s.actions:
        cells, i = [], 0
        while i < len(row):
            if i + 1 < len(row) and row[i].kind == "F" and row[i + 1].kind == "B":
                cells.append(f"({row[i]};{row[i + 1]})OVERLAP_F_B")
                i += 2
            else:
                cells.append(str(row[i]))
                i += 1
        rows.append(cells)
    text = "\n".join(",".join(cells) for cells in rows) + "\n"
    assert "OVERLAP_F_B" in text
    assert Schedule.from_csv(text).actions == s.actions


def test_csv_errors():
    with pytest.raises(ConfigError, match="column 1"):
        Schedule.from_csv("0F0,0X0\n1F0,1B0\n")
    with pytest.raises(ConfigError, match="chunk 0 has actions on rank 0 and rank 1"):
        Schedule.from_csv("0F0,0B0\n0F1,0B1\n")
    with pytest.raises(ConfigError, match="3 chunks over 2 ranks"):
        Schedule.from_csv("0F0,2F0,2B0,0B0\n1F0,1B0\n")
    with pytest.raises(ConfigError, match="deadlock"):  # imported schedules are validated
        Schedule.from_csv("0B0,0F0\n1F0,1B0\n")


def test_single_row_csv_text():
    s = Schedule.from_csv("0F0,0F1,0B0,0B1")
    assert s.num_ranks == 1 and s.microbatches == 2 and s.placement == (0,)
