"""How plait data prepare reads a task's records: JSON lines one at a time whatever their length (a very long
record costs about twice its bytes, not the whole task and its copies), the same documents, line numbers and
source hash however the lines fall across the blocks it reads."""

from __future__ import annotations

import hashlib
import json
import tracemalloc

import numpy as np

from plait.data import open_prepared, prepare, records

LONG = "tensor shards \"reduce\" naïve\n" * 300_000  # 8.7M characters, 11.1 MB as a JSON line


def test_a_very_long_json_line_costs_about_twice_its_bytes_while_prepared(tmp_path):
    src = tmp_path / "long.jsonl"
    with open(src, "w") as f:
        f.write(json.dumps({"text": "a short one"}) + "\n" + json.dumps({"text": LONG}) + "\n")
    size = src.stat().st_size
    tracemalloc.start()
    try:
        meta = prepare([str(src)], "bytes", tmp_path / "out", workers=1, held_out=0.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert meta["splits"]["train"]["tokens"] == len(b"a short one") + len(LONG.encode()) + 2
    ds = open_prepared(tmp_path / "out")
    assert bytes(ds.train.document(1)[:-1].astype(np.uint8)).decode() == LONG
    # the line's text (1 B a byte) and its value as a string (2 B a character), then that string and its UTF-8
    # bytes, the ids written in pieces; the whole task read at once, split into lines and its ids concatenated
    # came to 4.2 B a byte
    assert peak < 2.7 * size, f"{peak / size:.2f} bytes of memory a byte of the JSON line"


def test_lines_read_across_blocks_give_the_same_documents_lines_and_hash(tmp_path, monkeypatch):
    lines = [json.dumps({"text": "first"}), "", "   ", json.dumps({"text": "x" * 300}), "not json {",
             json.dumps({"body": "wrong field"}), json.dumps({"text": "é" * 70}), json.dumps({"text": " "}),
             json.dumps({"text": "no newline at the end"})]
    src = tmp_path / "mixed.jsonl"
    src.write_bytes("\n".join(lines).encode())
    out = {}
    for block in (1 << 20, 64, 7):  # a line longer than a block is found first, then read whole
        monkeypatch.setattr(records, "BLOCK", block)
        meta = prepare([str(src)], "bytes", tmp_path / f"out{block}", workers=1, held_out=0.0, skip_bad=True)
        ds = open_prepared(tmp_path / f"out{block}")
        texts = [bytes(ds.train.document(i)[:-1].astype(np.uint8)).decode() for i in range(ds.train.documents)]
        out[block] = texts, meta["sources"][0]
    texts, source = out[1 << 20]
    assert texts == ["first", "x" * 300, "é" * 70, "no newline at the end"]
    assert source["skipped_examples"] == [f"{src}:5: not valid JSON (Expecting value at column 1)",
                                          f"{src}:6: no 'text' field (fields: body); choose --text-field",
                                          f"{src}:8: blank text, no document"]
    whole = hashlib.blake2b(src.read_bytes(), digest_size=16).digest()  # one task: its bytes' hash, hashed
    assert source["blake2b"] == hashlib.blake2b(whole, digest_size=16).hexdigest()
    assert out[64] == out[7] == out[1 << 20]
