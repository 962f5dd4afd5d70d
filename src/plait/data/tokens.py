"""Tokenizers as ``plait data prepare`` uses them: UTF-8 bytes or a Hugging Face ``tokenizer.json``, batched,
with a fingerprint that ties a prepared dataset to the tokenizer that made it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plait.errors import ConfigError
from plait.tokenizers import BYTES, fingerprint_file, read_json_object

BYTES_EOS = 0  # byte-level models have no spare id: NUL, which text does not contain, ends a document
# end-of-text tokens of common tokenizers, tried in order when no config file names the EOS
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")


@dataclass(frozen=True)
class TokenizerSpec:
    """Where a tokenizer comes from (picklable: each worker process loads its own)."""

    source: str  # "bytes", a folder holding tokenizer.json, or a tokenizer.json file

    @property
    def file(self) -> Path | None:
        if self.source == BYTES:
            return None
        p = Path(self.source)
        return p / "tokenizer.json" if p.is_dir() else p

    def load(self) -> Tokens:
        return Tokens(self)


class Tokens:
    """A loaded tokenizer: ``encode_batch`` to flat ids, ``decode``, vocabulary size and fingerprint."""

    def __init__(self, spec: TokenizerSpec):
        self.spec, self.tok = spec, None
        path = spec.file
        if path is None:
            self.vocab_size, self.fingerprint, self.name = 256, BYTES, "UTF-8 bytes"
            return
        if not path.is_file():
            where = "no tokenizer.json there" if Path(spec.source).exists() else "no such file or folder"
            raise ConfigError(f"--tokenizer {spec.source}: {where}; give a folder holding tokenizer.json, the file "
                              "itself, or 'bytes'")
        from plait.tokenizers import FileTokenizer

        self.tok = FileTokenizer(path).tok  # the tokenizers library's Tokenizer: batched encoding below
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.fingerprint = fingerprint_file(path)
        self.name = str(path)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text: uint8 arrays over its UTF-8 bytes for ``bytes`` (no copy), else uint32."""
        if self.tok is None:
            return [np.frombuffer(t.encode("utf-8", errors="replace"), dtype=np.uint8) for t in texts]
        return [np.asarray(e.ids, dtype=np.uint32) for e in self.tok.encode_batch_fast(texts,
                                                                                     add_special_tokens=False)]

    def encode_masked(self, texts: list[str], spans: list[list[tuple[int, int]]]
                      ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Token ids of each text and its loss mask (uint8, one longer: the last entry is the EOS's): a token
        is in the loss when its characters overlap one of the text's character ``spans`` (a token straddling a
        span's edge included: transformers' ``return_assistant_tokens_mask``), the EOS when position
        ``len(text)`` lies in one."""
        out = []
        if self.tok is None:
            for text, sp in zip(texts, spans, strict=True):
                ids = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
                # a byte is in the loss when its character is, the EOS when position len(text) is
                out.append((ids, np.repeat(_inside(len(text) + 1, sp), np.append(_utf8_lengths(text), 1))))
            return out
        for text, sp, enc in zip(texts, spans, self.tok.encode_batch(texts, add_special_tokens=False), strict=True):
            offsets = np.asarray([*enc.offsets, (len(text), len(text) + 1)], dtype=np.int64).reshape(-1, 2)
            out.append((np.asarray(enc.ids, dtype=np.uint32), _overlapping(offsets[:, 0], offsets[:, 1], sp)))
        return out

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.tok is None:
            return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")
        return self.tok.decode(ids, skip_special_tokens=False)

    def eos(self, given: str | None) -> int:
        """The end-of-document id: ``given`` (an id or a token), else the one the tokenizer's folder names."""
        if given is not None:
            return self._id_of(given)
        if self.tok is None:
            return BYTES_EOS
        for name in self._named_eos():
            tid = self.tok.token_to_id(name)
            if tid is not None:
                return tid
        raise ConfigError(f"--tokenizer {self.spec.source}: no end-of-text token found (tokenizer_config.json, "
                          f"config.json or one of {', '.join(EOS_NAMES)}); give --eos ID or --eos TOKEN")

    def _id_of(self, given: str) -> int:
        if given.isdigit():
            tid: int | None = int(given)
        else:
            tid = self.tok.token_to_id(given) if self.tok is not None else None
        if tid is None or not 0 <= tid < self.vocab_size:
            raise ConfigError(f"--eos {given}: not a token id in [0, {self.vocab_size}) nor a token of "
                              f"{self.name}")
        return tid

    def _named_eos(self) -> list[str]:
        folder = self.spec.file.parent if self.spec.file is not None else Path(".")
        names: list[str] = []
        cfg = read_json_object(folder / "tokenizer_config.json")
        eos = cfg.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.append(eos)
        for file in ("generation_config.json", "config.json"):
            tid = read_json_object(folder / file).get("eos_token_id")
            tid = tid[0] if isinstance(tid, list) and tid else tid
            if isinstance(tid, int) and self.tok is not None:
                token = self.tok.id_to_token(tid)
                if token is not None:
                    names.append(token)
        return names + list(EOS_NAMES)


def _utf8_lengths(text: str) -> np.ndarray:
    """The bytes each character of ``text`` takes in ``text.encode("utf-8", errors="replace")``: 1 to 4 by its
    code point, 1 for a lone surrogate (which a JSON ``\\ud800`` escape can give; replaced by ``?``)."""
    points = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
    n = np.ones(len(points), dtype=np.uint8)
    for first in (0x80, 0x800, 0x10000):
        n += points >= first
    n[(points >= 0xD800) & (points < 0xE000)] = 1
    return n


def _inside(n: int, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 [n]: 1 at the positions in [0, n) that lie in one of the disjoint ranges [a, b)."""
    edges = np.zeros(n + 1, dtype=np.int8)  # +1 where a range starts, -1 where one ends
    if spans:
        lo, hi = np.minimum(np.asarray(spans, dtype=np.int64), n).T
        np.add.at(edges, lo, 1)
        np.add.at(edges, hi, -1)
    return (np.cumsum(edges[:n], dtype=np.int8) > 0).view(np.uint8)


def _overlapping(starts: np.ndarray, ends: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 [len(starts)]: 1 where token ``[starts[t], ends[t])`` (in text order) overlaps one of the sorted,
    disjoint character ranges [a, b): the first range ending after the token's start begins before its end
    (transformers' ``apply_chat_template(return_assistant_tokens_mask=True)`` marks tokens this way)."""
    if not spans:
        return np.zeros(len(starts), dtype=np.uint8)
    lo = np.asarray([a for a, _ in spans], dtype=np.int64)
    hi = np.asarray([b for _, b in spans], dtype=np.int64)
    k = np.searchsorted(hi, starts, side="right")  # the first range with b > the token's start
    return ((k < len(spans)) & (ends > lo[np.minimum(k, len(spans) - 1)])).astype(np.uint8)


def model_fingerprint(model: str) -> tuple[str, str]:
    """(fingerprint, description) of the tokenizer ``plait train --model`` reads: a folder's own
    tokenizer.json, else UTF-8 bytes (the presets)."""
    path = Path(model) / "tokenizer.json"
    if path.is_file():
        return fingerprint_file(path), f"{path}"
    return BYTES, "UTF-8 bytes"
