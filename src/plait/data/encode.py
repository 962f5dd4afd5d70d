"""Documents to token ids by split, as ``plait data prepare`` and raw ``plait train --data`` tokenize them:
each document followed by the EOS, held out when the hash of its text falls under the held-out share, handed
to its split's sink (a task's shard files, or memory) one document at a time."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from plait.data.chat import Spans
from plait.data.format import SPLITS
from plait.data.tokens import Tokens

ENCODE_BATCH = 512  # documents per tokenizer call


class Sink(Protocol):
    def document(self, ids: np.ndarray, mask: np.ndarray | None) -> None:
        """One document's ids (without its EOS) and its loss mask (with the EOS's entry) or None."""
        ...


def encode_into(sinks: dict[str, Sink], docs: list[str], tok: Tokens, held_out: float,
                spans: list[Spans] | None = None, keys: list[int] | None = None) -> None:
    """Every document of ``docs`` into the sink of its split, in order; with ``spans`` (the characters of each
    document in the loss) its mask beside. A document is held out when the hash of its text (of
    ``docs[keys[i]]``'s, given ``keys``) falls under ``held_out``."""
    limit = int(held_out * 2**64)
    held = [doc_hash(text) < limit for text in docs]
    if keys is not None:
        held = [held[k] for k in keys]
    for i in range(0, len(docs), ENCODE_BATCH):
        batch = docs[i:i + ENCODE_BATCH]
        encoded: list[tuple[np.ndarray, np.ndarray | None]] = (
            [(ids, None) for ids in tok.encode_batch(batch)] if spans is None
            else list(tok.encode_masked(batch, spans[i:i + ENCODE_BATCH])))
        for j, (ids, mask) in enumerate(encoded):
            sinks["held_out" if held[i + j] else "train"].document(ids, mask)


def doc_hash(text: str) -> int:
    """The 64-bit hash of a document's text that decides its split."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "replace"), digest_size=8).digest(), "little")


@dataclass
class Encoded:
    """One split's part of a task: ids [tokens], document lengths [documents], loss mask [tokens] or None."""

    ids: np.ndarray
    lengths: np.ndarray
    mask: np.ndarray | None = None


class MemorySink:
    """A split's documents gathered in memory, concatenated into the stored dtype at the end."""

    def __init__(self, dtype: str, eos: int):
        self.dtype, self.end = dtype, np.asarray([eos], dtype=np.uint32)
        self.parts: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []

    def document(self, ids: np.ndarray, mask: np.ndarray | None) -> None:
        self.parts += [ids, self.end]
        if mask is not None:
            self.masks.append(mask)

    def encoded(self, masked: bool) -> Encoded:
        ids = (np.concatenate(self.parts, dtype=self.dtype, casting="same_kind") if self.parts
               else np.zeros(0, self.dtype))
        mask = np.concatenate(self.masks or [np.zeros(0, np.uint8)]) if masked else None
        return Encoded(ids, np.asarray([len(a) + 1 for a in self.parts[::2]], dtype=np.int64), mask)


def encode_documents(docs: list[str], tok: Tokens, eos: int, held_out: float, dtype: str,
                     spans: list[Spans] | None = None, keys: list[int] | None = None) -> dict[str, Encoded]:
    """Per split, in memory: token ids of its documents, each followed by ``eos``; int64 document lengths; with
    ``spans`` the uint8 loss mask beside the ids (``encode_into``)."""
    sinks = {s: MemorySink(dtype, eos) for s in SPLITS}
    encode_into(dict(sinks), docs, tok, held_out, spans, keys)
    return {s: sink.encoded(spans is not None) for s, sink in sinks.items()}
