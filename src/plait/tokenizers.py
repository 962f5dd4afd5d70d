"""Tokenizers shared by training, generation and serving: UTF-8 bytes, or a Hugging Face ``tokenizer.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from plait.errors import ConfigError


class Tokenizer(Protocol):
    """What plait needs of a tokenizer: text to ids and back, and the vocabulary size."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


class FileTokenizer:
    """A Hugging Face ``tokenizer.json`` (read with the ``tokenizers`` package)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:  # a base dependency: only a broken install gets here
            raise ConfigError(f"{path} needs the 'tokenizers' package, which is missing: "
                              "pip install tokenizers (or reinstall plait)") from None
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception type
            raise ConfigError(f"{path}: not a Hugging Face tokenizer.json ({exc})") from None
        self.vocab_size = self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode([int(i) for i in ids])


def tokenizer_for(model: str) -> ByteTokenizer | FileTokenizer:
    """A folder's own ``tokenizer.json`` when it has one, else UTF-8 bytes (the presets are byte-level).

    Never falls back to bytes for a folder that has a tokenizer: that would feed a real model garbage.
    """
    path = Path(model) / "tokenizer.json"
    return FileTokenizer(path) if path.is_file() else ByteTokenizer()
