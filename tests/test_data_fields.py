"""plait data prepare --text-field per source: FIELD for every SRC, SRC=FIELD for one; a SRC whose records have
no such field is refused before anything is tokenized, naming the SRC and the fields its records have."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from plait.cli.main import app
from plait.data import open_prepared, prepare
from plait.errors import ConfigError


def _texts(out) -> list[str]:
    ds = open_prepared(out)
    return [bytes(ds.train.document(i)[:-1].astype(np.uint8)).decode() for i in range(ds.train.documents)]


def _jsonl(path, field, texts):
    path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)))
    return str(path)


def test_each_source_reads_its_own_field(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.chdir(tmp_path)
    (tmp_path / "web").mkdir()
    _jsonl(tmp_path / "web" / "a.jsonl", "text", ["web one", "web two"])
    _jsonl(tmp_path / "wiki.jsonl", "body", ["wiki one"])
    pq.write_table(pa.table({"content": ["book one", "book two"], "title": ["a", "b"]}), "books.parquet")
    (tmp_path / "notes.txt").write_text("a plain note")
    res = CliRunner().invoke(app, ["data", "prepare", "web", "wiki.jsonl", "books.parquet", "notes.txt", "--tokenizer",
                                   "bytes", "--out", "out", "--workers", "1", "--held-out", "0", "--text-field",
                                   "wiki.jsonl=body", "--text-field", "books.parquet=content"])
    assert res.exit_code == 0, res.output
    assert _texts("out") == ["web one", "web two", "wiki one", "book one", "book two", "a plain note"]
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert [s.get("text_field") for s in meta["sources"]] == ["text", "body", "content", None]
    # FIELD for every SRC with one SRC's own beside it
    _jsonl(tmp_path / "b.jsonl", "body", ["b body"])
    prepare(["wiki.jsonl", "b.jsonl", "web"], "bytes", "both", workers=1, held_out=0.0,
            text_field=["body", "web=text"])
    assert _texts("both") == ["wiki one", "b body", "web one", "web two"]


def test_a_source_without_its_field_is_refused_naming_it_and_its_fields(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    web = _jsonl(tmp_path / "web.jsonl", "text", ["web one"])
    wiki = _jsonl(tmp_path / "wiki.jsonl", "body", ["wiki one", "wiki two"])
    # --skip-bad skipped every record of wiki.jsonl (the dataset was web.jsonl alone); the SRC is refused instead
    with pytest.raises(ConfigError) as err:
        prepare([web, wiki], "bytes", "out", workers=1, skip_bad=True)
    assert str(err.value) == (f"SRC {wiki}: its records have no 'text' field (the first of {wiki} have: id, body); "
                              f"choose --text-field {wiki}=FIELD for this SRC (--text-field FIELD names every SRC's)")
    with pytest.raises(ConfigError, match=rf"SRC {wiki}: its records have no 'title' field .*; choose another "
                                          rf"--text-field {wiki}=FIELD"):
        prepare([web, wiki], "bytes", "out", workers=1, text_field=[f"{wiki}=title"])
    with pytest.raises(ConfigError, match=rf"SRC {wiki}: .*no 'text' field .*; choose --text-field FIELD$"):
        prepare([wiki], "bytes", "out", workers=1)
    (tmp_path / "notes.txt").write_text("a note")
    for given, says in (([f"{tmp_path}/wiki=body"], f"--text-field {tmp_path}/wiki=body: {tmp_path}/wiki is no SRC "
                                                    f"of this prepare ({web}, {wiki}, notes.txt)"),
                        (["notes.txt=body"], "--text-field notes.txt=body: SRC notes.txt is plain text"),
                        (["body", "title"], "--text-field body and --text-field title: one field for every SRC"),
                        ([f"{wiki}=body", f"{wiki}=title"], f"--text-field {wiki}=body and {wiki}=title: one field"),
                        ([f"{wiki}="], f"--text-field {wiki}=: no field named")):
        with pytest.raises(ConfigError) as err:
            prepare([web, wiki, "notes.txt"], "bytes", "out", workers=1, text_field=given)
        assert str(err.value).startswith(says), err.value
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
