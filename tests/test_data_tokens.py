"""Tokenizing for plait data prepare at the cost of the text: a document's ids without copies wider than the
stored dtype."""

from __future__ import annotations

import tracemalloc

import numpy as np

from plait.data.prepare import encode_documents
from plait.data.tokens import TokenizerSpec


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
