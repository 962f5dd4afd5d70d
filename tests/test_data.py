"""plait data prepare and the sample stream, in one process: sources read back exactly, bad records, a killed
prepare, the sample order (layout-independent rows, epochs, mixtures) and the checks against the model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from data_util import EOS, bpe_folder, documents, write_jsonl
from harness import alive
from plait.cli.main import app
from plait.data import open_prepared, prepare
from plait.data.stream import check_entries, open_data, prepared_source
from plait.errors import ConfigError


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return bpe_folder(tmp_path_factory.mktemp("bpe"))


def _expected(tok_folder, docs):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_folder / "tokenizer.json"))
    return tok, [len(tok.encode(d, add_special_tokens=False).ids) + 1 for d in docs]


def _read_back(out, docs, tok, counts):
    """Every document is in exactly one split, with its tokens + EOS, decoding back to its text."""
    ds = open_prepared(out)
    eos = tok.token_to_id(EOS)
    assert ds.meta["dtype"] == "uint16" and ds.tokenizer["eos"] == eos
    assert ds.train.tokens + ds.held_out.tokens == sum(counts)
    assert ds.train.documents + ds.held_out.documents == len(docs)
    by_text = {}
    for split in (ds.train, ds.held_out):
        for i in range(split.documents):
            ids = split.document(i)
            assert ids[-1] == eos and eos not in ids[:-1].tolist()
            by_text[tok.decode(ids[:-1].tolist(), skip_special_tokens=False)] = len(ids)
    want = dict(zip(docs, counts, strict=True))
    assert by_text == want
    return ds


def test_jsonl_prepared_and_read_back_same_with_two_workers(tmp_path, bpe, monkeypatch):
    import plait.data.sources

    monkeypatch.setattr(plait.data.sources, "CHUNK", 8192)  # several tasks, so that two workers share them
    docs = documents(400)
    src = write_jsonl(tmp_path / "c.jsonl", docs)
    tok, counts = _expected(bpe, docs)
    meta = prepare([str(src)], str(bpe), tmp_path / "one", workers=1, held_out=0.1)
    ds = _read_back(tmp_path / "one", docs, tok, counts)
    assert 0 < ds.held_out.documents < 0.25 * len(docs), "about a tenth of the documents held out"
    assert meta["sources"][0]["documents"] == len(docs) and len(meta["sources"][0]["blake2b"]) == 32
    two = prepare([str(src)], str(bpe), tmp_path / "two", workers=2, held_out=0.1)
    assert len(two["splits"]["train"]["shards"]) > 3
    for split in ("train", "held_out"):
        a, b = (getattr(open_prepared(tmp_path / n), split) for n in ("one", "two"))
        assert np.array_equal(a.read(0, a.tokens), b.read(0, b.tokens)), "workers changed the dataset"


def test_parquet_text_and_datasets_folder_prepared(tmp_path, bpe):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = documents(120, seed=2)
    tok, counts = _expected(bpe, docs)
    pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}), tmp_path / "c.parquet", row_group_size=50)
    prepare([str(tmp_path / "c.parquet")], str(bpe), tmp_path / "pq", workers=1, text_field="body", held_out=0.2)
    _read_back(tmp_path / "pq", docs, tok, counts)
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, d in enumerate(docs[:30]):
        (texts / f"{i:03d}.txt").write_text(d)
    prepare([str(texts)], str(bpe / "tokenizer.json"), tmp_path / "txt", workers=1, held_out=0.0)
    _read_back(tmp_path / "txt", docs[:30], tok, counts[:30])
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "hf"))
    prepare([str(tmp_path / "hf")], str(bpe), tmp_path / "hfout", workers=1)
    _read_back(tmp_path / "hfout", docs, tok, counts)


def test_bytes_prepare_uses_uint16_and_nul_eos(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", ["héllo", "wörld"])
    prepare([str(src)], "bytes", tmp_path / "out", workers=1, held_out=0.0)
    ds = open_prepared(tmp_path / "out")
    assert ds.tokenizer["fingerprint"] == "bytes" and ds.tokenizer["eos"] == 0
    assert bytes(ds.train.read(0, ds.train.tokens).tolist()) == "héllo".encode() + b"\0" + "wörld".encode() + b"\0"


def test_malformed_line_names_file_and_line_or_is_counted(tmp_path):
    src = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(10)]
    lines[3], lines[4], lines[5] = '{"text": null}', "[1, 2]", '{"text": 5}'  # named in JSON's words
    lines[6] = json.dumps({"body": "no text field"})
    lines[8] = "{not json"
    src.write_text("\n".join(lines) + "\n")
    res = CliRunner().invoke(app, ["data", "prepare", str(src), "--tokenizer", "bytes", "--out", str(tmp_path / "o"),
                                   "--workers", "1"])
    assert res.exit_code == 2 and f"{src}:4: 'text' is null, not text" in res.output, res.output  # was NoneType
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))  # no task finished: nothing kept
    meta = prepare([str(src)], "bytes", tmp_path / "o", workers=1, skip_bad=True, held_out=0.0)
    assert meta["sources"][0]["skipped"] == 5 and meta["splits"]["train"]["documents"] == 5
    assert [e.removeprefix(f"{src}:") for e in meta["sources"][0]["skipped_examples"]] == [
        "4: 'text' is null, not text", "5: an array, not an object with a 'text' field", "6: 'text' is a number, not "
        "text", "7: no 'text' field (fields: body); choose --text-field", "9: not valid JSON (Expecting property name "
        "enclosed in double quotes at column 2)"]


def test_killed_prepare_leaves_nothing_loadable(tmp_path, bpe):
    src = write_jsonl(tmp_path / "big.jsonl", documents(30000, max_words=120))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "plait.cli.main", "data", "prepare", str(src), "--tokenizer", str(bpe),
           "--out", str(out), "--workers", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob(".out.partial/train/*.bin")):
        time.sleep(0.02)
    assert proc.poll() is None, "prepare finished before it could be killed: make the input larger"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (tmp_path / ".out.partial").is_dir() and not out.exists(), "the partial output sits aside"
    with pytest.raises(ConfigError, match="not a prepared dataset"):
        open_prepared(out)
    prepare([str(write_jsonl(tmp_path / "small.jsonl", documents(20)))], "bytes", out, workers=1, restart=True)
    assert open_prepared(out).train.tokens > 0 and not list(tmp_path.glob(".out.*")), "partial folder removed"


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_stopped_prepare_ends_its_workers_and_says_what_it_keeps(tmp_path, bpe, sig):
    """Ctrl-C (SIGINT to the process group) or SIGTERM to the prepare alone: one line, no tracebacks, no worker left."""
    src = write_jsonl(tmp_path / "big.jsonl", documents(30000, max_words=120))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "plait.cli.main", "data", "prepare", str(src), "--tokenizer", str(bpe),
           "--out", str(out), "--workers", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    deadline = time.time() + 120
    while time.time() < deadline and len(_workers(proc.pid)) < 2:  # stopped while the workers start or work
        time.sleep(0.02)
    time.sleep(0.5)
    assert proc.poll() is None, "prepare finished before it could be stopped: make the input larger"
    if sig == "SIGINT":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    number = getattr(signal, sig)
    assert proc.returncode == 128 + number, (proc.returncode, err)
    kept = len(list(tmp_path.glob(".out.partial/done/*.npz")))  # the tasks finished before the stop, kept
    note = f"; {kept} finished task{'s' * (kept != 1)} kept in {tmp_path}/.out.partial: the same command resumes"
    assert err == f"plait data prepare: stopped ({sig}); --out {out} left as it was" + (
        f"{note} (--restart starts over)\n" if kept else "\n"), err
    assert not out.exists() and (tmp_path / ".out.partial").exists() == bool(kept), "kept only to resume"
    deadline = time.time() + 10
    while time.time() < deadline:  # the workers (the same process group) end with it
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("workers left running after the prepare stopped")


def test_killed_prepare_s_workers_end_quietly(tmp_path, bpe):
    """SIGKILL to the prepare alone (no time to end its pool): its workers end within a second or so, without
    finishing their tasks and printing a traceback for the result no one receives."""
    src = write_jsonl(tmp_path / "big.jsonl", documents(30000, max_words=120))
    cmd = [sys.executable, "-m", "plait.cli.main", "data", "prepare", str(src), "--tokenizer", str(bpe),
           "--out", str(tmp_path / "out"), "--workers", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and not list(tmp_path.glob(".out.partial/train/*.bin")):  # the workers are working
        time.sleep(0.02)
    workers = _workers(proc.pid)
    assert proc.poll() is None and len(workers) == 2, "prepare finished before it could be killed: a larger input"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(alive(w) for w in workers):
        time.sleep(0.05)
    assert not any(alive(w) for w in workers), "workers left running after their parent died"
    err = proc.stderr.read()  # every writer of the pipe has ended
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def _workers(pid: int) -> list[str]:
    """The pool workers ``pid`` started (from /proc)."""
    try:
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return []
    out = []
    for c in children:
        try:
            if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read():
                out.append(c)
        except OSError:
            pass
    return out


def _prepared(tmp_path, name, texts, held_out=0.0):
    src = write_jsonl(tmp_path / f"{name}.jsonl", texts)
    prepare([str(src)], "bytes", tmp_path / name, workers=1, held_out=held_out)
    return str(tmp_path / name)


def test_rows_of_a_step_do_not_depend_on_the_split_over_replicas(tmp_path):
    path = _prepared(tmp_path, "a", documents(200))
    data = open_data([path], "tiny", 256, 16, 8, seed=3, max_mb=1)
    for step in (0, 5, 123):
        x, y = data.batch(step)
        assert x.shape == (8, 16) and np.array_equal(x[:, 1:], y[:, :-1])
        for n in (2, 4, 8):
            parts = [data.batch(step, (i, n)) for i in range(n)]
            assert all(np.array_equal(np.concatenate([p[k] for p in parts]), (x, y)[k]) for k in (0, 1))
    assert not np.array_equal(data.batch(0)[0], open_data([path], "tiny", 256, 16, 8, 4, 1).batch(0)[0])


def test_epochs_visit_every_window_once_in_a_new_order(tmp_path):
    path = _prepared(tmp_path, "a", ["".join(chr(65 + i) * 10 for i in range(5))])  # 51 tokens: 5 windows of 11
    data = open_data([path], "tiny", 256, 10, 5, seed=0, max_mb=1)  # one batch = one epoch
    epochs = [data.batch(e)[0][:, 0].tolist() for e in range(3)]  # each window's first token: A, B, ...
    assert all(sorted(e) == [65, 66, 67, 68, 69] for e in epochs) and len(set(map(tuple, epochs))) > 1, epochs
    assert data.position(3) == {"epoch": 3.0, "tokens_seen": 150}


def test_a_resumed_run_counts_the_tokens_and_passes_its_checkpoint_saw(tmp_path):
    """Resumed at step 3 with another batch size and window length: the 3 steps saved count as they were read."""
    path = _prepared(tmp_path, "a", ["".join(chr(65 + i) * 10 for i in range(5))])  # 5 windows of 11, 2 of 21
    saved = open_data([path], "tiny", 256, 10, 5, seed=0, max_mb=1)  # one batch = one epoch
    meta = {"data": saved.position(3), "train": {"batch_size": 5, "seq_len": 10, "data": [path]}}
    data = open_data([path], "tiny", 256, 20, 1, seed=0, max_mb=1)  # one batch = half an epoch
    data.resume_at(3, meta, same_data=True)
    assert data.position(5) == {"epoch": 4.0, "tokens_seen": 150 + 2 * 20}  # was 5 steps of 20: 100, epoch 2.5
    old = open_data([path], "tiny", 256, 20, 1, seed=0, max_mb=1)  # a checkpoint without the counts
    old.resume_at(3, {"train": meta["train"]}, same_data=True)
    assert old.position(5) == {"epoch": 4.0, "tokens_seen": 190}  # from its run's batch size and length
    other = open_data([path], "tiny", 256, 20, 1, seed=0, max_mb=1)  # other data: its passes count from step 3
    other.resume_at(3, meta, same_data=False)
    assert other.position(5) == {"epoch": 1.0, "tokens_seen": 190}
    same = open_data([path], "tiny", 256, 10, 5, seed=0, max_mb=1)
    same.resume_at(3, meta, same_data=True)
    assert same.carried is None and same.position(4) == {"epoch": 4.0, "tokens_seen": 200}


def test_a_resumed_run_with_another_batch_size_reads_on_without_a_gap_or_a_repeat(tmp_path):
    """3 steps of 4, then another batch size (larger, smaller, then larger again): the samples read are the
    uninterrupted order's, across epoch boundaries (26 windows, a new permutation each epoch)."""
    path = _prepared(tmp_path, "a", ["".join(chr(65 + i) * 10 for i in range(26))])  # 26 windows of 11
    whole = open_data([path], "tiny", 256, 10, 1, seed=2, max_mb=1)  # batch size 1: batch g is sample g
    order = np.concatenate([whole.batch(g)[0].numpy() for g in range(90)])  # [90, 10]: three epochs and more
    for sizes in ((4, 7, 9), (4, 3, 5), (7, 2, 1)):
        read, steps, meta = [], 3, None
        for b in sizes:
            data = open_data([path], "tiny", 256, 10, b, seed=2, max_mb=1)
            start = 0 if meta is None else meta["data"]["next_step"]
            if meta is not None:
                data.resume_at(start, meta, same_data=True)
            read += [data.batch(k, (i, 2 if b % 2 == 0 else 1))[0].numpy()
                     for k in range(start, start + steps) for i in range(2 if b % 2 == 0 else 1)]
            meta = {"data": {"next_step": start + steps, **data.saved_counts(start + steps)},
                    "train": {"batch_size": b, "seq_len": 10, "data": [path]}}
            steps += 1
        rows = np.concatenate(read)
        assert np.array_equal(rows, order[:len(rows)]), (sizes, rows[:, 0], order[:len(rows), 0])
        n = len(rows)
        assert meta["data"]["samples"] == n and meta["data"]["tokens_seen"] == n * 10
        assert meta["data"]["epoch"] == round(n / 26, 4)


def test_mixture_proportions_within_two_percent_over_10000_windows(tmp_path):
    web = _prepared(tmp_path, "web", ["w" * 5000])
    code = _prepared(tmp_path, "code", ["c" * 700])  # a small source: it repeats through many epochs
    data = open_data([f"0.7:{web}", f"0.3:{code}"], "tiny", 256, 8, 100, seed=1, max_mb=1)
    first = np.concatenate([data.batch(k)[0][:, 0].numpy() for k in range(100)])  # 10,000 windows
    share = float((first == ord("w")).mean())
    assert abs(share - 0.7) < 0.02, share
    pos = data.position(100)
    assert pos["epochs"][code] > 3 and pos["epoch"] == pos["epochs"][code]


def test_too_short_and_tokenizer_mismatch_are_config_errors(tmp_path, bpe):
    short = _prepared(tmp_path, "short", ["tiny text"])
    with pytest.raises(ConfigError, match=r"10 training tokens in 1 document,.*--seq-len 32 needs at least 33"):
        check_entries([short], "tiny", 256, 32)
    src = write_jsonl(tmp_path / "c.jsonl", documents(50))
    prepare([str(src)], str(bpe), tmp_path / "bpe-set", workers=1)
    with pytest.raises(ConfigError) as err:
        prepared_source(str(tmp_path / "bpe-set"), 1.0, "tiny", 256)
    fp = open_prepared(tmp_path / "bpe-set").tokenizer["fingerprint"]
    assert fp in str(err.value) and "fingerprint bytes" in str(err.value) and "UTF-8 bytes" in str(err.value)
    assert str(err.value).endswith(f"prepare it again with --tokenizer bytes, or give --model a model folder "
                                   f"(config.json) whose tokenizer.json is {bpe / 'tokenizer.json'}'s")
    model = tmp_path / "model"  # a model folder with this tokenizer but a vocabulary too small for it
    from plait.models import Llama, LlamaConfig

    Llama(LlamaConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, max_seq_len=32)).save_pretrained(model)
    (model / "tokenizer.json").write_bytes((bpe / "tokenizer.json").read_bytes())
    with pytest.raises(ConfigError, match=r"vocabulary \d+ exceeds --model .* vocab_size 64"):
        prepared_source(str(tmp_path / "bpe-set"), 1.0, str(model), 64)


def test_prepare_out_through_a_file_is_an_error(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", documents(5))
    (tmp_path / "a-file").write_text("")
    for out, args, needle in ((tmp_path / "a-file" / "set", [], "is a file, so nothing can be made under it"),
                              (tmp_path / "a-file", ["--force"], "a file, not a folder")):
        res = CliRunner().invoke(app, ["data", "prepare", str(src), "--tokenizer", "bytes", "--out", str(out), *args])
        assert res.exit_code == 2 and res.output.startswith(f"error: --out {out}: ") and needle in res.output, \
            res.output


def test_a_file_named_parquet_that_is_not_one_is_an_error(tmp_path):
    pytest.importorskip("pyarrow")
    for name, content in (("empty.parquet", b""), ("text.parquet", b"not parquet at all")):
        (tmp_path / name).write_bytes(content)
        res = CliRunner().invoke(app, ["data", "prepare", str(tmp_path / name), "--tokenizer", "bytes", "--out",
                                       str(tmp_path / "out")])
        assert res.exit_code == 2 and res.output.startswith(f"error: SRC {tmp_path / name}: not a readable Parquet "
                                                            "file ("), res.output


def test_empty_plain_text_is_an_error_before_launch(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "none").mkdir()
    for data in (tmp_path / "empty.txt", tmp_path / "none"):
        with pytest.raises(ConfigError, match=f"--data {data}: no text there"):
            check_entries([str(data)], "tiny", 256, 32)
    (tmp_path / "none" / "a.txt").write_text("some text")
    check_entries([str(tmp_path / "none")], "tiny", 256, 32)


def test_raw_text_shorter_than_one_sequence_is_an_error_before_launch(tmp_path, monkeypatch):
    """Raw text (like a prepared dataset) holding fewer than --seq-len + 1 training tokens: one error naming the
    path, its tokens and --seq-len, before any worker starts."""
    import plait.distributed.launch as launch

    def launched(*args, **kwargs):
        raise AssertionError("launched before the data's length was checked")

    monkeypatch.setattr(launch, "launch", launched)
    (tmp_path / "tiny.txt").write_text("hello world, a short text.\n")  # 27 bytes + EOS
    flags = ["train", "--tp", "1", "--pp", "1", "--nproc", "1", "--steps", "1", "--seq-len", "64"]
    for data in (tmp_path / "tiny.txt", _prepared(tmp_path, "short", ["hello world, a short text.\n"])):
        res = CliRunner().invoke(app, [*flags, "--data", str(data)])
        assert res.exit_code == 2 and res.output.startswith(
            f"error: --data {data}: 28 training tokens in 1 document, but --seq-len 64 needs at least 65 tokens"), \
            res.output


def test_a_mixture_weight_of_zero_or_below_is_named(tmp_path):
    data = _prepared(tmp_path, "c", documents(20))
    for weight in ("0", "-1", "-0.5"):
        with pytest.raises(ConfigError, match=f"--data {weight}:.*: the weight must be > 0"):
            check_entries([f"{weight}:{data}"], "tiny", 256, 32)


def test_raw_jsonl_is_never_trained_as_json_text(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", documents(50))
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "notes.txt").write_text("plain text\n")
    write_jsonl(folder / "more.jsonl", documents(5))
    for data in (src, folder):
        res = CliRunner().invoke(app, ["train", "--data", str(data)])
        assert res.exit_code == 2 and "plait data prepare" in res.output and "JSON lines" in res.output, res.output
    plain = open_data([str(folder / "notes.txt")], "tiny", 256, 4, 2, 0, 1)  # text files stay usable
    assert bytes(plain.sources[0].train.read(0, 11).tolist()) == b"plain text\n"


def test_held_out_batches_are_fixed_and_from_the_held_out_split(tmp_path):
    path = _prepared(tmp_path, "h", documents(400), held_out=0.2)
    data = open_data([path], "tiny", 256, 64, 4, 0, 1)  # rows long enough to be found in one split only
    ds = open_prepared(path)
    held = bytes(ds.held_out.read(0, ds.held_out.tokens).tolist())  # byte ids: the stream as bytes
    train = bytes(ds.train.read(0, ds.train.tokens).tolist())
    x, _ = data.held_out_batch(1)
    assert np.array_equal(x, data.held_out_batch(1)[0])
    rows = [bytes(row.tolist()) for row in x]
    assert all(r in held for r in rows) and not any(r in train for r in rows)


def test_a_tokenizer_path_that_is_not_there_is_told_apart_from_a_folder_without_tokenizer_json(tmp_path):
    for path, why in ((tmp_path / "nope", "no such file or folder"), (tmp_path, "no tokenizer.json there")):
        with pytest.raises(ConfigError, match=f"^--tokenizer {path}: {why}; give a folder holding tokenizer.json"):
            prepare([str(tmp_path)], str(path), tmp_path / "o", workers=1)
