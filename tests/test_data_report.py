"""plait data prepare at 80 columns: its --help, and its summary, whose heading and notes under the table (speed,
chat rendering, skipped records by reason) wrap at the console's width, left-aligned, not at the narrow table's."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console
from typer.testing import CliRunner

from plait.cli.main import app
from plait.data import prepare
from plait.data.chat import ChatSpec


def test_the_summary_heading_and_notes_use_the_whole_80_columns(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short paths: a narrow table
    src = Path("c.jsonl")
    chat = [{"role": "user", "content": "hello world, what is the weather?"}, {"role": "assistant", "content": "sun"}]
    src.write_text(json.dumps({"messages": chat}) + "\n" + json.dumps({"messages": 3}) + "\n")
    out = io.StringIO()
    prepare([str(src)], "bytes", "p", workers=1, held_out=0.0, skip_bad=True, chat=ChatSpec("bytes"),
            console=Console(file=out, width=80, highlight=False))
    lines = out.getvalue().splitlines()
    table = next(len(line) for line in lines if line.startswith("┏"))
    assert table < 70 and all(len(line.rstrip()) <= 80 for line in lines)
    assert lines[0] == "plait data prepare: p (UTF-8 bytes, vocabulary 256, EOS 0, uint16)"
    below = lines[lines.index(next(line for line in lines if line.startswith("└"))) + 1:]
    text = " ".join(line.strip() for line in below)
    assert " training shard" in below[0] and below[1].startswith("chat: 'messages' rendered with plait's <|role|>")
    assert len(below[1].rstrip()) > table  # the note runs past the table's width, to the console's
    assert "the loss on assistant tokens" in text
    assert below[-2].startswith("skipped (1 'messages' is ") and below[-2].endswith("messages), e.g.:")
    assert below[-1].startswith("  c.jsonl:2: 'messages' is ")  # the example on a line of its own


def test_skipped_records_are_counted_by_reason_with_an_example_of_each_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines = [json.dumps({"text": f"document {i}"}) for i in range(20)]
    for n in (2, 3, 4, 5):
        lines[n] = '{"text": "cut off'  # an unterminated string: JSON says where it starts
    lines[9], lines[12], lines[13], lines[15] = '{"text": "  "}', '{"text": 7}', '{"body": "x"}', '{"text": ""}'
    Path("w.jsonl").write_text("\n".join(lines) + "\n")
    out = io.StringIO()
    meta = prepare(["w.jsonl"], "bytes", "p", workers=1, held_out=0.0, skip_bad=True,
                   console=Console(file=out, width=200, highlight=False))
    src = meta["sources"][0]
    assert src["skipped"] == 8 and src["skipped_reasons"] == {
        "not valid JSON": 4, "blank text, no document": 2, "'text' is a number, not text": 1, "no 'text' field": 1}
    assert src["skipped_examples"] == [  # the first of each reason, then the earliest other
        "w.jsonl:3: not valid JSON (Unterminated string starting at column 10)",
        "w.jsonl:4: not valid JSON (Unterminated string starting at column 10)",
        "w.jsonl:10: blank text, no document", "w.jsonl:13: 'text' is a number, not text",
        "w.jsonl:14: no 'text' field (fields: body); choose --text-field"]
    said = out.getvalue().splitlines()
    start = said.index("skipped (4 not valid JSON; 2 blank text, no document; 1 'text' is a number, not text; 1 no "
                       "'text' field), e.g.:")
    assert said[start + 1:] == [f"  {e}" for e in src["skipped_examples"]]


def test_a_held_out_split_the_hash_left_empty_is_named_with_the_way_to_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("t.jsonl").write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(3)))
    said = {}
    for share in (1e-9, 0.0):  # a share that chose none of the 3 (it said nothing), and no held-out split asked
        out = io.StringIO()
        prepare(["t.jsonl"], "bytes", f"p{share:g}", workers=1, held_out=share,
                console=Console(file=out, width=80, highlight=False))
        said[share] = " ".join(line.strip() for line in out.getvalue().splitlines())
    assert ("held_out: no document (the hash of each text chose none of 3 documents at --held-out 1e-09, about 3e-09 "
            "expected): plait train --data shows no held-out loss; for one, prepare again with a larger --held-out "
            "(--force)") in said[1e-9], said[1e-9]
    assert "held_out: no document" not in said[0.0], said[0.0]


def test_the_help_fits_80_columns_and_says_what_a_stop_and_a_bad_record_do():
    res = CliRunner().invoke(app, ["data", "prepare", "--help"], env={"COLUMNS": "80"})
    assert res.exit_code == 0 and max(len(line) for line in res.output.splitlines()) <= 80, res.output
    said = " ".join(res.output.split())
    assert "stops the prepare, named by file:line; --skip-bad skips such records and counts them by reason" in said
    assert "A prepare stopped (Ctrl-C, a kill, a full disk) keeps its finished tasks in a hidden folder beside " \
           "--out (.NAME.partial): the same command again resumes" in said and "--restart discards" in said
