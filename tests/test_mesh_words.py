"""A layout's mesh in words ('tp 2 x cp 2 x pp 1 x dp 1'), one spelling wherever plait prints it."""

from __future__ import annotations

from plait.cli.progress import layout_words
from plait.parallel_config import ParallelConfig
from plait.train.report import layout_text
from plait.train.resume import saved_layout
from plait.words import mesh


def test_mesh_names_cp_only_where_there_is_context_parallelism():
    assert mesh(2, 2, 1) == "tp 2 x pp 2 x dp 1"
    assert mesh(1, 1, 2, cp=1, cp_comm="ring") == "tp 1 x pp 1 x dp 2"
    assert mesh(2, 1, 1, cp=2) == "tp 2 x cp 2 x pp 1 x dp 1"
    assert mesh(2, 1, 1, cp=2, cp_comm="ring") == "tp 2 x cp 2 (ring) x pp 1 x dp 1"
    assert mesh(1, 2, "to fill --nproc") == "tp 1 x pp 2 x dp to fill --nproc"


def test_the_start_line_the_resume_note_and_the_summary_spell_a_mesh_alike():
    par = ParallelConfig(tp=2, cp=2, pp=2, dp=1, microbatches=2)
    meta = {"train": {"tp": 2, "cp": 2, "pp": 2, "dp": 1}, "layout": {"zero": 1}}
    assert layout_words(par) == "tp 2 x cp 2 x pp 2 x dp 1"
    assert saved_layout(meta) == "tp 2 x cp 2 x pp 2 x dp 1, ZeRO-1"
    assert layout_text(par).startswith(f"tp 2 x cp 2 ({par.cp_comm}) x pp 2 x dp 1 (8 processes), 1f1b")
    assert layout_words(ParallelConfig(tp=2, pp=1, dp=-1)) == "tp 2 x pp 1 x dp to fill --nproc"
