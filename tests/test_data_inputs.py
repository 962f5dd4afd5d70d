"""What plait data prepare and plait train --data make of awkward inputs (text that is not UTF-8, ...), and what a
prepare leaves behind in the process that called it."""

from __future__ import annotations

import gc
import weakref

import pytest
from typer.testing import CliRunner

from plait.cli.main import app
from plait.data import prepare
from plait.data.raw import raw_inputs
from plait.data.stream import open_data
from plait.data.tokens import TokenizerSpec
from plait.errors import ConfigError

LATIN1 = "line one\nline two café\n".encode("latin-1")  # byte 0xe9 at column 13 of line 2


def _prepare(*args: str):
    return CliRunner().invoke(app, ["data", "prepare", *args, "--tokenizer", "bytes", "--workers", "1"])


def test_text_that_is_not_utf8_is_named_never_trained_as_replacement_characters(tmp_path):
    (tmp_path / "latin.txt").write_bytes(LATIN1)
    (tmp_path / "latin.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    for name, line in (("latin.txt", 2), ("latin.jsonl", 2)):  # the JSON line was a UnicodeDecodeError traceback
        res = _prepare(str(tmp_path / name), "--out", str(tmp_path / "out"))
        assert res.exit_code == 2, res.output
        assert res.stderr.startswith(f"error: {tmp_path / name}:{line}: not UTF-8 text (byte 0xe9 at column "), \
            res.stderr
        assert "--skip-bad" in res.stderr and not (tmp_path / "out").exists()
    (tmp_path / "good.txt").write_text("naïve café\n")
    meta = prepare([str(tmp_path / n) for n in ("latin.txt", "latin.jsonl", "good.txt")], "bytes", tmp_path / "out",
                   workers=1, held_out=0.0, skip_bad=True)
    assert [s["skipped"] for s in meta["sources"]] == [1, 1, 0]
    assert meta["splits"]["train"]["tokens"] == len(b"fine") + len("naïve café\n".encode()) + 2  # each with its EOS


def test_train_data_that_is_not_utf8_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("plain text " * 20)
    (tmp_path / "texts" / "b.txt").write_bytes(LATIN1)
    res = CliRunner().invoke(app, ["train", "--tp", "1", "--pp", "1", "--steps", "1", "--seq-len", "8",
                                   "--batch-size", "1", "--microbatches", "1", "--data", str(tmp_path / "texts")])
    assert res.exit_code == 2 and res.stderr.startswith(
        f"error: --data {tmp_path / 'texts'}: {tmp_path / 'texts' / 'b.txt'}:2: not UTF-8 text"), res.output
    (tmp_path / "texts" / "b.txt").unlink()
    assert open_data([str(tmp_path / "texts")], "tiny", 256, 8, 1, 0, 1).sources[0].files == 1


def test_a_file_named_twice_is_refused_not_read_twice(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("some text " * 50)
    for srcs in (["corpus", "corpus/a.txt"], ["corpus", "corpus"], ["corpus/a.txt", "corpus/../corpus/a.txt"]):
        res = _prepare(*(str(tmp_path / s) for s in srcs), "--out", str(tmp_path / "out"))
        assert res.exit_code == 2 and f"SRC {tmp_path / srcs[1]}: " in res.stderr and "would be read twice" in \
            res.stderr, res.output  # its documents were in the dataset twice
    assert not (tmp_path / "out").exists()


def test_hidden_folders_and_prepared_datasets_in_a_source_folder_are_never_text(tmp_path):
    (tmp_path / "corpus" / ".git").mkdir(parents=True)
    (tmp_path / "corpus" / "a.txt").write_text("some text " * 50)
    (tmp_path / "corpus" / ".git" / "pre-commit.sample").write_text("#!/bin/sh\nexit 0\n")  # was a document
    meta = prepare([str(tmp_path / "corpus")], "bytes", tmp_path / "corpus" / "prepared", workers=1, held_out=0.0)
    assert meta["splits"]["train"]["documents"] == 1 and meta["sources"][0]["files"] == 1
    again = _prepare(str(tmp_path / "corpus"), "--out", str(tmp_path / "corpus" / "prepared"), "--force")
    assert again.exit_code == 2 and again.stderr.startswith(  # was its own meta.json as a bad JSON line
        f"error: SRC {tmp_path / 'corpus'} holds a prepared dataset, {tmp_path / 'corpus' / 'prepared'}, whose "
        "shards and meta.json are no text"), again.output
    (tmp_path / "corpus" / "b.txt.gz").write_bytes(b"\x1f\x8b")
    for named, why in ((tmp_path / "corpus", f"holds a prepared dataset, {tmp_path}/corpus/prepared, whose shards and "
                        f"meta.json are no text to read: give --data {tmp_path}/corpus/prepared to train on it"),
                       (tmp_path / "corpus" / "b.txt.gz", f": {tmp_path}/corpus/b.txt.gz is gzip-compressed")):
        with pytest.raises(ConfigError) as exc:  # plait train --data of raw text: its flag, not prepare's SRC
            raw_inputs(str(named), "tiny")
        assert str(exc.value).startswith(f"--data {named}{' ' if why[0] != ':' else ''}{why}"), exc.value


def test_prepare_without_a_terminal_prints_progress_lines(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    import plait.data.report as report
    import plait.data.sources as sources
    from data_util import write_jsonl

    monkeypatch.setattr(sources, "CHUNK", 256)  # tasks of ~256 bytes: several of them
    monkeypatch.setattr(report, "LINE_EVERY_S", 0.0)
    src = write_jsonl(tmp_path / "c.jsonl", [f"document {i} " * 8 for i in range(40)])
    log = io.StringIO()  # a batch job's log: no live bar (there was no output at all until the summary)
    prepare([str(src)], "bytes", tmp_path / "out", workers=1, console=Console(file=log, width=200))
    lines = [ln for ln in log.getvalue().splitlines() if ln.startswith("prepare: ")]
    assert len(lines) >= 3 and lines[0].startswith("prepare: 0.0 of 0.0 MB (") and "tokens" in lines[0], lines
    assert "left" in lines[-1] and "(100%)" not in log.getvalue()
    log = io.StringIO()  # a log at 50 columns: each line whole (at 80, a 2 GB corpus's ended '... about 4 min')
    prepare([str(src)], "bytes", tmp_path / "out50", workers=1, console=Console(file=log, width=50))
    said = log.getvalue().splitlines()
    lines = [ln for ln in said if ln.startswith("prepare: ")]
    assert len(lines) >= 3 and all(ln.endswith(" left") for ln in lines), said


def test_force_replaces_only_a_prepared_dataset_never_other_files(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("precious text " * 20)
    (tmp_path / "mine" / "other").mkdir(parents=True)
    (tmp_path / "mine" / "other" / "notes.txt").write_text("keep")
    for out in ("corpus", "mine"):  # each was deleted, the source corpus itself included
        res = _prepare(str(tmp_path / "corpus"), "--out", str(tmp_path / out), "--force")
        assert res.exit_code == 2 and res.stderr.startswith(
            f"error: --out {tmp_path / out} --force: {tmp_path / out} is not a prepared dataset"), res.output
    assert (tmp_path / "corpus" / "a.txt").is_file() and (tmp_path / "mine" / "other" / "notes.txt").is_file()
    (tmp_path / "empty").mkdir()
    for _ in range(2):  # an empty folder, then the prepared dataset made there
        assert _prepare(str(tmp_path / "corpus"), "--out", str(tmp_path / "empty"), "--force").exit_code == 0


def test_a_json_array_file_is_named_with_the_command_that_converts_it(tmp_path):
    import json

    (tmp_path / "arr.json").write_text(json.dumps([{"text": f"doc {i}"} for i in range(5)], indent=2))
    res = _prepare(str(tmp_path / "arr.json"), "--out", str(tmp_path / "out"))
    assert res.exit_code == 2 and res.stderr.startswith(  # was 'arr.json:1: not valid JSON ... pass --skip-bad'
        f"error: SRC {tmp_path / 'arr.json'}: one JSON array, but .json/.jsonl/.ndjson files are read as JSON lines "
        f"(one object per line); convert it first: jq -c '.[]' {tmp_path / 'arr.json'} > {tmp_path / 'arr.jsonl'}"), \
        res.output


def test_blank_records_are_skipped_and_counted_not_trained_as_lone_eos(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "one"}\n{"text": ""}\n{"text": " \\n"}\n{"text": "two"}\n')
    meta = prepare([str(tmp_path / "c.jsonl")], "bytes", tmp_path / "out", workers=1, held_out=0.0)
    assert meta["splits"]["train"]["documents"] == 2 and meta["splits"]["train"]["tokens"] == 8  # "one" EOS "two" EOS
    assert meta["sources"][0]["skipped"] == 2
    assert meta["sources"][0]["skipped_examples"] == [f"{tmp_path / 'c.jsonl'}:{n}: blank text, no document"
                                                      for n in (2, 3)]


def test_empty_text_files_are_skipped_and_counted_not_trained_as_lone_eos(tmp_path):
    (tmp_path / "t").mkdir()
    for name, text in (("a.txt", "one"), ("b.txt", ""), ("c.txt", " \n"), ("d.txt", "two")):
        (tmp_path / "t" / name).write_text(text)
    meta = prepare([str(tmp_path / "t")], "bytes", tmp_path / "out", workers=1, held_out=0.0)
    assert meta["splits"]["train"]["documents"] == 2 and meta["splits"]["train"]["tokens"] == 8  # "one" EOS "two" EOS
    assert meta["sources"][0]["skipped"] == 2
    assert meta["sources"][0]["skipped_examples"] == [f"{tmp_path / 't' / n}:1: blank text, no document"
                                                      for n in ("b.txt", "c.txt")]
    source = open_data([str(tmp_path / "t")], "tiny", 256, 2, 1, 0, 1).sources[0]  # plait train --data, unprepared
    assert (source.train.tokens + source.held_out.tokens, source.files) == (8, 4)
    assert source.note == "2 of them left out (empty, binary or not UTF-8)"


def test_an_out_made_by_another_prepare_meanwhile_is_an_error_not_a_traceback(tmp_path, monkeypatch):
    import importlib

    prepare_module = importlib.import_module("plait.data.prepare")  # (plait.data.prepare is also the function)

    (tmp_path / "a.txt").write_text("some text " * 20)
    meta = prepare_module._meta

    def racing(*args, **kwargs):  # a second prepare into the same --out finishes first
        (tmp_path / "out" / "train").mkdir(parents=True)
        (tmp_path / "out" / "meta.json").write_text("{}")
        return meta(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "_meta", racing)
    res = _prepare(str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"))
    assert res.exit_code == 2 and res.stderr.startswith(  # was OSError: [Errno 39] Directory not empty
        f"error: --out {tmp_path / 'out'}: made by someone else while this prepare ran"), res.output
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # its own folder removed


def test_raw_text_cut_by_max_data_mb_says_how_much_was_read(tmp_path):
    (tmp_path / "texts").mkdir()
    for i in range(3):
        (tmp_path / "texts" / f"{i}.txt").write_text(f"file {i} " * 500)  # 3,500 tokens each
    cut = open_data([str(tmp_path / "texts")], "tiny", 256, 8, 1, 0, 0.005)  # 5,000 tokens: two files
    assert cut.describe().endswith("; the first 2 of 3 files: --max-data-mb 0.005)"), cut.describe()  # was silent
    whole = open_data([str(tmp_path / "texts")], "tiny", 256, 8, 1, 0, 1)
    assert "the first" not in whole.describe() and whole.sources[0].files == 3


def test_the_same_data_twice_is_refused_naming_both_entries(tmp_path):
    """Each source runs its own epochs, counted by its name: the same data twice was one `epochs` entry for two
    sources. It is refused before launch (its weight says how much of the mixture it is)."""
    import pytest

    from plait.errors import ConfigError

    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("plain text " * 20)
    (tmp_path / "other.txt").write_text("other text " * 20)
    d = str(tmp_path / "texts")
    res = CliRunner().invoke(app, ["train", "--tp", "1", "--pp", "1", "--steps", "1", "--seq-len", "8", "--batch-size",
                                   "1", "--microbatches", "1", "--data", d, "--data", d, "--dry-run"])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: --data {d}: names the same data as --data {d}; give "
                                                        "each source once"), res.output
    with pytest.raises(ConfigError, match=rf"--data 0.5:{tmp_path}/texts/../texts: names the same data as --data "
                                          rf"0.7:{d};"):
        open_data([f"0.7:{d}", str(tmp_path / "other.txt"), f"0.5:{d}/../texts"], "tiny", 256, 8, 1, 0, 1)
    both = open_data([d, str(tmp_path / "other.txt")], "tiny", 256, 8, 2, 0, 1)
    assert set(both.position(3)["epochs"]) == {d, str(tmp_path / "other.txt")}


def test_a_file_inside_another_entrys_folder_is_refused_naming_both(tmp_path):
    """A folder's files are all read, its sub-folders' too: a file (or folder) inside it given as another --data
    entry would be read twice, its documents silently weighted twice. Refused, either order."""
    import pytest

    from plait.errors import ConfigError

    (tmp_path / "texts" / "sub").mkdir(parents=True)
    (tmp_path / "texts" / "a.txt").write_text("plain text " * 20)
    (tmp_path / "texts" / "sub" / "b.txt").write_text("more text " * 20)
    d, a = str(tmp_path / "texts"), str(tmp_path / "texts" / "a.txt")
    res = CliRunner().invoke(app, ["train", "--tp", "1", "--pp", "1", "--steps", "1", "--seq-len", "8", "--batch-size",
                                   "1", "--microbatches", "1", "--data", d, "--data", a, "--dry-run"])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: --data {a}: is inside the folder --data {d}, which "
                                                        "reads it too; give each file once"), res.output
    with pytest.raises(ConfigError, match=rf"--data {d}/sub: is inside the folder --data 0.7:{d}/\.\./texts,"):
        open_data([f"{d}/sub", f"0.7:{d}/../texts"], "tiny", 256, 8, 1, 0, 1)
    apart = open_data([f"{d}/sub", a], "tiny", 256, 8, 2, 0, 1)  # siblings: each read once
    assert {s.files for s in apart.sources} == {1}


def test_a_chat_dataset_with_first_character_masks_is_refused_naming_the_command_that_remakes_it(tmp_path):
    """A plait-tokens/2 chat dataset's masks hold a token by its first character, plait-tokens/3's by any of its
    characters: a /2 chat dataset is refused, naming the command that remakes it; a /2 text dataset reads."""
    import json

    import pytest

    from plait.data import open_prepared
    from plait.data.chat import ChatSpec
    from plait.data.format import FORMAT, META
    from plait.errors import ConfigError

    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi?"},
                                                               {"role": "assistant", "content": "Hello."}]}) + "\n")
    (tmp_path / "t.txt").write_text("plain text " * 20)
    prepare([str(tmp_path / "c.jsonl")], "bytes", tmp_path / "chat", workers=1, held_out=0.0, chat=ChatSpec("bytes"))
    prepare([str(tmp_path / "t.txt")], "bytes", tmp_path / "text", workers=1, held_out=0.0)
    for name in ("chat", "text"):
        assert open_prepared(tmp_path / name).meta["format"] == FORMAT == "plait-tokens/3"
        meta = json.loads((tmp_path / name / META).read_text())
        (tmp_path / name / META).write_text(json.dumps({**meta, "format": "plait-tokens/2"}))
    assert open_prepared(tmp_path / "text").train.tokens == 221  # no masks: read as before
    with pytest.raises(ConfigError) as err:
        open_prepared(tmp_path / "chat")
    assert str(err.value).startswith(f"{tmp_path / 'chat'}: a chat dataset of format plait-tokens/2, whose loss masks "
                                     "hold a token only when its first character is the assistant's;"), err.value
    assert f"prepare it again with `plait data prepare SRC... --chat --out {tmp_path / 'chat'} --force`" in \
        str(err.value)
    res = CliRunner().invoke(app, ["train", "--tp", "1", "--pp", "1", "--microbatches", "1", "--batch-size", "1",
                                   "--seq-len", "8", "--data", str(tmp_path / "chat"), "--dry-run"])
    assert res.exit_code == 2 and "plait data prepare SRC... --chat" in res.stderr, res.output


def test_bad_records_deep_in_a_large_file_are_located_once_each_in_bounded_memory(tmp_path, monkeypatch):
    import json
    import tracemalloc

    import plait.data.skipped as skipped
    import plait.data.sources as sources

    monkeypatch.setattr(sources, "CHUNK", 64 << 10)  # ~64 tasks, a bad record in a dozen of them
    monkeypatch.setattr(sources, "LINE_BLOCK", 256 << 10)
    lines = [json.dumps({"text": f"document {i} " * 30}) for i in range(12000)]  # ~4.5 MB
    bad = list(range(1000, 12000, 900))
    for n in bad:
        lines[n] = "{not json"
    src = tmp_path / "big.jsonl"
    src.write_text("\n".join(lines) + "\n")
    located = []
    monkeypatch.setattr(skipped, "where", lambda rec: located.append(rec) or sources.where(rec))
    meta = prepare([str(src)], "bytes", tmp_path / "out", workers=1, skip_bad=True, held_out=0.0)
    assert meta["sources"][0]["skipped"] == len(bad)
    assert [e.split(": ")[0] for e in meta["sources"][0]["skipped_examples"]] == [f"{src}:{n + 1}" for n in bad[:5]]
    assert len(located) == 5, "only the examples kept are located (each costs a read of the file up to it)"
    tracemalloc.start()  # the last one, ~4.4 MB into the file: read block by block, never whole
    assert sources.where(located[-1]) == f"{src}:{bad[4] + 1}"
    rec = sources.BadRecord(str(src), src.stat().st_size - 10, 0, "x")
    assert sources.where(rec) == f"{src}:{len(lines)}"
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 3 * sources.LINE_BLOCK < src.stat().st_size / 5, peak


def test_a_dataset_of_many_shards_opens_without_a_memory_map_or_descriptor_per_shard(tmp_path, monkeypatch):
    """A map per shard held a descriptor per shard too: a 2 GB corpus (898 shards, 4 MB of input each, in each
    split) failed to open under `ulimit -n 512` (1,024 is a common default), and vm.max_map_count (65,530) bounds
    the maps whatever the limit."""
    import os

    import plait.data.sources as sources
    from data_util import documents, write_jsonl
    from plait.data import open_prepared

    monkeypatch.setattr(sources, "CHUNK", 2048)
    src = write_jsonl(tmp_path / "c.jsonl", documents(3000, max_words=30))
    prepare([str(src)], "bytes", tmp_path / "out", workers=1, held_out=0.2)

    def maps_and_fds() -> tuple[int, int]:
        with open("/proc/self/maps") as f:
            return len(f.readlines()), len(os.listdir("/proc/self/fd"))

    before = maps_and_fds()
    ds = open_prepared(tmp_path / "out")
    after = maps_and_fds()
    shards = len(ds.meta["splits"]["train"]["shards"]) + len(ds.meta["splits"]["held_out"]["shards"])
    assert shards > 200 and after[0] - before[0] < 10 and after[1] - before[1] < 4, (shards, before, after)
    whole = ds.train.read(0, ds.train.tokens)  # across every shard, in order
    assert [bytes(ds.train.document(i)) for i in (0, ds.train.documents - 1)] == [
        bytes(whole[: ds.train.docs[1]]), bytes(whole[ds.train.docs[-2]:])]


def test_a_prepare_in_the_callers_process_keeps_no_tokenizer_after_it_returns(tmp_path, monkeypatch):
    loaded: list[weakref.ref] = []
    load = TokenizerSpec.load

    def recorded(spec):
        tok = load(spec)
        loaded.append(weakref.ref(tok))
        return tok

    monkeypatch.setattr(TokenizerSpec, "load", recorded)
    (tmp_path / "a.txt").write_text("one document\n")
    prepare([str(tmp_path / "a.txt")], "bytes", tmp_path / "out", workers=1, held_out=0.0)
    gc.collect()
    assert len(loaded) == 2 and [ref() for ref in loaded] == [None, None]  # the parent's and the encoder's


def test_a_compressed_source_is_named_with_the_command_that_unpacks_it_never_skipped_as_binary(tmp_path):
    import gzip

    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "a.txt").write_text("some text")
    (tmp_path / "web" / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "hidden"}\n'))
    for src, move in ((tmp_path / "web" / "b.jsonl.gz", ""), (tmp_path / "web", f", or move it out of {tmp_path}/web")):
        res = _prepare(str(src), "--out", str(tmp_path / "out"))  # was read as a binary text file and skipped
        assert res.exit_code == 2 and res.stderr.strip() == (
            f"error: SRC {src}: {tmp_path}/web/b.jsonl.gz is gzip-compressed, which plait does not read; unpack it "
            f"first (gunzip -k {tmp_path}/web/b.jsonl.gz) and name what it holds{move}"), res.output


def test_a_prepare_with_nothing_to_train_on_says_why(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "bin.dat").write_bytes(b"\x7fELF\0\0")
    (tmp_path / "one.jsonl").write_text('{"text": "only one"}\n')
    why = {"empty.jsonl": "0 skipped): every SRC is empty (0 bytes): name files that hold text",
           "blank.jsonl": "0 skipped): no record holds text",
           "bin.dat": f"1 skipped): every record was skipped, the first at {tmp_path}/bin.dat:1: binary (a NUL byte "
                      "in its first KB), not text"}
    for name, end in why.items():  # each said only '(0 held out, N skipped)'
        res = _prepare(str(tmp_path / name), "--out", str(tmp_path / "out"))
        assert res.exit_code == 2 and res.stderr.strip() == (
            f"error: SRC {tmp_path / name}: no documents for the training split (0 held out, {end}"), res.output
    res = _prepare(str(tmp_path / "one.jsonl"), "--out", str(tmp_path / "out"), "--held-out", "0.9999")
    assert res.exit_code == 2 and res.stderr.strip().endswith(
        "(1 held out, 0 skipped): every document went to the held-out split: lower --held-out 0.9999"), res.output


def test_the_prepare_bar_counts_speed_and_time_left_from_the_start_not_from_the_last_chunk(tmp_path, monkeypatch):
    """A task's bytes arrive at once when it ends: the bar's MB/s and time left are the bytes done over the time
    since the start, each look at the (stand-in) clock here 1 ms later. rich's own columns read a chunk's
    megabytes over the milliseconds between two results: a 50 MB prepare showed 128.5 GB/s, 0:00:01 left, for
    minutes, and 'starting workers' while they tokenized."""
    import io
    import itertools
    import re
    import time

    from rich.console import Console

    import plait.data.sources as sources
    from data_util import write_jsonl

    monkeypatch.setattr(sources, "CHUNK", 2000)  # tasks of ~2 kB: several of them
    src = write_jsonl(tmp_path / "c.jsonl", [f"document {i} " * 40 for i in range(60)])
    n = len(sources.tasks(sources.discover([str(src)]), "text"))
    clock = itertools.count(0.0, 0.001)
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    log = io.StringIO()
    meta = prepare([str(src)], "bytes", tmp_path / "out", workers=1, held_out=0.0,
                   console=Console(file=log, width=80, force_terminal=True))  # a terminal of 80 columns
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", log.getvalue())
    assert "1 worker, 4 MB chunks" in shown, shown
    size, tokens = src.stat().st_size, meta["splits"]["train"]["tokens"]
    last = re.search(r"prepare .* 31\.7/31\.7 kB 0:00:\d\d ([\d.]+) MB/s, ([\d.]+)([Mk]) tok/s, 0 s left", shown)
    assert last, shown
    speed, rate = float(last[1]) * 1e6, float(last[2]) * (1e6 if last[3] == "M" else 1e3)
    assert n > 3 and 0.1e6 < speed <= size / (n * 0.001), last[0]  # the whole run's bytes over its clock's reads
    assert abs(rate / speed - tokens / size) < 0.06 * tokens / size, last[0]  # tokens/s over the same time
