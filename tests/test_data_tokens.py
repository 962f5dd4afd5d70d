"""Tokenizing for plait data prepare at the cost of the text: the bytes tokenizer's ids and chat loss masks
without a step per character, and a document's ids without copies wider than the stored dtype; the tokens a
prepared source holds as plait train's data line counts them."""

from __future__ import annotations

import sys
import tracemalloc

import numpy as np

from plait.data import prepare
from plait.data.encode import encode_documents
from plait.data.stream import open_data
from plait.data.tokens import TokenizerSpec

# ASCII, 2-, 3- and 4-byte characters, and a lone surrogate (a JSON "\ud800" escape), which UTF-8 writes as "?"
TEXT = "ab naïve 東京 🚀 x\ud800y 日本語 é"


def _reference_mask(text: str, spans: list[tuple[int, int]]) -> np.ndarray:
    """One entry per UTF-8 byte of ``text`` (its character in a span) and one for the EOS (position len(text))."""
    inside = [any(a <= c < b for a, b in spans) for c in range(len(text) + 1)]
    sizes = [len(ch.encode("utf-8", errors="replace")) for ch in text] + [1]
    return np.asarray([m for m, n in zip(inside, sizes, strict=True) for _ in range(n)], dtype=np.uint8)


def test_bytes_ids_and_chat_mask_follow_each_characters_utf8_bytes():
    tok = TokenizerSpec("bytes").load()
    cases = [[], [(0, 2)], [(3, 9), (9, 12)], [(11, 14), (15, 18)], [(14, len(TEXT) + 1)], [(0, len(TEXT))]]
    for spans in cases:
        [(ids, mask)] = tok.encode_masked([TEXT], [spans])
        assert bytes(ids.astype(np.uint8)) == TEXT.encode("utf-8", errors="replace")
        assert mask.dtype == np.uint8 and mask.tolist() == _reference_mask(TEXT, spans).tolist(), spans


def test_a_bytes_chat_mask_costs_no_call_per_character():
    tok = TokenizerSpec("bytes").load()
    text = TEXT * 5000  # 130,000 characters
    spans = [(i, i + 40) for i in range(0, len(text), 100)]
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "c_call"

    sys.setprofile(count)
    try:
        [(ids, mask)] = tok.encode_masked([text], [spans])
    finally:
        sys.setprofile(None)
    assert len(mask) == len(ids) + 1
    assert calls < 200, f"{calls} calls of built-in functions for {len(text):,} characters"


def test_a_long_documents_ids_are_built_without_copies_wider_than_the_stored_dtype():
    tok = TokenizerSpec("bytes").load()
    text = "tensor shards " * 600_000  # 8.4 MB: one document far longer than the rest of its task
    tracemalloc.start()
    try:
        out = encode_documents([text], tok, 0, 0.0, "uint16")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    ids = out["train"].ids
    assert ids.dtype == np.uint16 and len(ids) == len(text) + 1 and ids[-1] == 0
    assert bytes(ids[:-1].astype(np.uint8)) == text.encode()
    # at the peak, its UTF-8 bytes and the uint16 ids: 1 + 2 bytes a character (no uint32 copy of them)
    assert peak < 3.5 * len(text), f"{peak / len(text):.1f} bytes a character at the peak"


def test_the_data_line_counts_a_small_sources_tokens_in_full_and_a_large_ones_in_millions(tmp_path):
    (tmp_path / "small.txt").write_text("tensor shards " * 350)  # 4,900 bytes and its EOS
    (tmp_path / "large.txt").write_text("pipeline stage " * 20_000)
    for name in ("small", "large"):
        prepare([str(tmp_path / f"{name}.txt")], "bytes", tmp_path / name, workers=1, held_out=0.0)
    line = open_data([f"0.5:{tmp_path / 'small'}", f"0.5:{tmp_path / 'large'}"], "tiny", 256, 16, 2, 0, 1).describe()
    assert "(prepared: 4,901 training tokens, none held out)" in line, line  # was 0.00M training tokens, 0.00M
    assert "(prepared: 0.30M training tokens, none held out)" in line, line
