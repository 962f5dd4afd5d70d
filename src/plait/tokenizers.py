"""Tokenizers shared by training, generation and serving: UTF-8 bytes, or a Hugging Face ``tokenizer.json``."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Protocol

from plait.errors import ConfigError


class Tokenizer(Protocol):
    """What plait needs of a tokenizer: text to ids and back (``skip_special_tokens``: without the special tokens'
    text, as generated text is shown), one id's vocabulary string, and the vocabulary size."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token(self, i: int) -> str: ...

    def token_bytes(self, i: int) -> bytes: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")  # bytes: none is special

    def token(self, i: int) -> str:
        return self.decode([i])

    def token_bytes(self, i: int) -> bytes:
        return bytes([int(i) % 256])


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
        self.path = Path(path)
        self.vocab_size = self.tok.get_vocab_size()
        self.byte_level: bool | None = None  # read from the decoder when first needed

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token(self, i: int) -> str:
        """Id ``i``'s string in the vocabulary (byte-level BPE's "Ġthe", a special token's own text); "" for an id
        past it (a model's padded rows)."""
        return self.tok.id_to_token(int(i)) or ""

    def token_bytes(self, i: int) -> bytes:
        """Id ``i``'s own bytes, also where they are only part of a character: a byte-level BPE token's (its
        vocabulary string through GPT-2's byte-to-character table), a byte-fallback token's ("<0xE6>"), else
        the UTF-8 of its text."""
        word = self.token(i)
        if self._byte_level() and word and all(c in BYTE_OF_CHAR for c in word):
            return bytes(BYTE_OF_CHAR[c] for c in word)
        fallback = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", word)
        return bytes([int(fallback.group(1), 16)]) if fallback else self.decode([i]).encode()

    def _byte_level(self) -> bool:
        """Whether the tokenizer's decoder maps vocabulary characters to bytes (ByteLevel, alone or in a
        Sequence)."""
        if self.byte_level is None:
            decoder = json.loads(self.tok.to_str()).get("decoder") or {}
            parts = (decoder.get("decoders") or [decoder]) if isinstance(decoder, dict) else []
            self.byte_level = any(isinstance(d, dict) and d.get("type") == "ByteLevel" for d in parts)
        return self.byte_level


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte, inverted."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + n): b for n, b in enumerate(moved)}}


BYTE_OF_CHAR = _byte_of_char()


#: prompt tokens a continuation is decoded after (``after_prompt``)
CONTEXT_TOKENS = 5


def after_prompt(tok: Tokenizer, prompt: list[int]) -> list[int]:
    """The last CONTEXT_TOKENS ids of ``prompt``, which a continuation's text is decoded after: a tokenizer drops
    the leading space of the text it decodes (SentencePiece's "▁The", a Metaspace or Strip decoder), so a
    continuation decoded alone loses the space that parts it from its prompt ("The capital" + "of", not " of").
    [] when they do not decode to whole characters (a prompt ending inside one): then it is decoded alone."""
    tail = [int(i) for i in prompt[-CONTEXT_TOKENS:]]
    return [] if "\ufffd" in tok.decode(tail) else tail


def continuation(tok: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text ``ids`` add after ``prompt``: prompt + continuation reads as the two decoded together."""
    tail = after_prompt(tok, prompt)
    head, whole = tok.decode(tail), tok.decode(tail + [int(i) for i in ids])
    return whole[len(head):] if whole.startswith(head) else tok.decode(list(ids))


def tokenizer_for(model: str) -> ByteTokenizer | FileTokenizer:
    """A folder's own ``tokenizer.json`` when it has one, else UTF-8 bytes (the presets are byte-level).

    Never falls back to bytes for a folder that has a tokenizer: that would feed a real model garbage.
    """
    path = Path(model) / "tokenizer.json"
    return FileTokenizer(path) if path.is_file() else ByteTokenizer()


def check_fits(tok: ByteTokenizer | FileTokenizer, vocab_size: int, model: str) -> None:
    """ConfigError when the ids of ``tok``, the tokenizer of ``--model model``, do not all fit the model's vocabulary
    of ``vocab_size`` ids (UTF-8 bytes need 256; a tokenizer.json its own): an id past it has no embedding row.
    plait train, generate and serve refuse such a model before launching, whatever the prompts or data."""
    if tok.vocab_size <= vocab_size:
        return
    if isinstance(tok, FileTokenizer):
        source = "its tokenizer.json" if tok.path.parent == Path(model) else str(tok.path)
    else:
        source = "bytes (no tokenizer.json)"
    raise ConfigError(f"--model {model}: vocabulary {vocab_size} cannot hold the {tok.vocab_size} ids of {source} "
                      f"(ids from {vocab_size} on would have no embedding row)")


BYTES = "bytes"  # the fingerprint of UTF-8 bytes (no tokenizer.json)
#: the files of a model folder that go with its tokenizer: ids, special tokens, chat template, end-of-sequence ids
TOKENIZER_DIR = "tokenizer"  # a checkpoint's copy of the TOKENIZER_FILES of the folder its model was trained from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def fingerprint_file(path: Path) -> str:
    """A short hash of a tokenizer.json's model (vocabulary, merges), normaliser, pre-tokeniser and added
    tokens: two files that tokenize alike but differ in whitespace or key order get the same fingerprint."""
    raw = json.loads(path.read_text())
    keep = {k: raw.get(k) for k in ("model", "normalizer", "pre_tokenizer", "added_tokens")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def read_json_object(path: Path) -> dict:
    """A model folder's JSON file (its config, tokenizer config, generation config) as a dict: {} when it is
    missing, unreadable, not UTF-8 JSON or not an object, as for a folder that does not say."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def eos_ids(folder: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids a model folder names (``generation_config.json``, else ``config.json``: its
    ``eos_token_id``, one id or a list), where generation stops; () when it names none."""
    root = Path(folder)
    gen, cfg = read_json_object(root / "generation_config.json"), read_json_object(root / "config.json")
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    return tuple(int(i) for i in eos) if isinstance(eos, list) else () if eos is None else (int(eos),)


def tokenizer_record(model: str) -> dict:
    """What a checkpoint keeps of the tokenizer of ``plait train --model``: the model folder, as an absolute path
    (a later command may run in another directory), and its tokenizer.json's fingerprint ('bytes' when it has
    none, and for the presets, which have no folder)."""
    path = Path(model)
    if not path.is_dir():
        return {"folder": None, "fingerprint": BYTES}
    file = path / "tokenizer.json"
    return {"folder": str(path.resolve()), "fingerprint": fingerprint_file(file) if file.is_file() else BYTES}


def trained_tokenizer(meta: dict, checkpoint: str | Path) -> tuple[Path | None, ByteTokenizer | FileTokenizer]:
    """(the folder of the tokenizer files a checkpoint's model was trained with, or None; its tokenizer), from the
    checkpoint's ``meta.json``: the checkpoint's own copy of them (TOKENIZER_DIR, which a save writes), else the
    folder it was trained from. ConfigError when, without the copy, that folder's tokenizer.json is gone or is
    another one: decoding with UTF-8 bytes instead would turn every id into the wrong text."""
    from plait.model_presets import PRESETS

    record = meta.get("tokenizer")
    if record is None:  # written before checkpoints kept the record: only --model, as it was typed
        model = meta.get("train", {}).get("model", "tiny")
        if model in PRESETS:
            return None, ByteTokenizer()
        record = {"folder": model, "fingerprint": None}
    folder = Path(record["folder"]) if record.get("folder") else None
    kept = Path(checkpoint) / TOKENIZER_DIR  # the copy a checkpoint keeps (none in one saved before it did)
    if folder is not None and kept.is_dir():
        if record["fingerprint"] == BYTES:
            return kept, ByteTokenizer()
        if (kept / "tokenizer.json").is_file() and fingerprint_file(kept / "tokenizer.json") == record["fingerprint"]:
            return kept, FileTokenizer(kept / "tokenizer.json")
    if record["fingerprint"] == BYTES:
        return (folder if folder is not None and folder.is_dir() else None), ByteTokenizer()
    assert folder is not None
    file = folder / "tokenizer.json"
    if record["fingerprint"] is None and folder.is_dir():
        return folder, tokenizer_for(str(folder))
    trained = f"{checkpoint}: its model was trained with the tokenizer of {folder}"
    if not file.is_file():
        where = "" if folder.is_absolute() else f" (from {Path.cwd()}; run where the model was trained)"
        raise ConfigError(f"{trained}, and {file} is not there{where}: put the folder back (its ids would decode as "
                          "the wrong text)")
    if record["fingerprint"] is not None and fingerprint_file(file) != record["fingerprint"]:
        raise ConfigError(f"{trained}, whose {file} has changed since (fingerprint {fingerprint_file(file)}, trained "
                          f"with {record['fingerprint']}); restore the folder's tokenizer.json")
    return folder, FileTokenizer(file)


def check_tokenizer_out(folder: Path | None, out: Path) -> None:
    """ConfigError when a model whose tokenizer files are in ``folder`` (None: UTF-8 bytes) written to ``out`` would
    leave a tokenizer.json there that is not the model's."""
    if (folder is None or not (folder / "tokenizer.json").is_file()) and (out / "tokenizer.json").is_file():
        raise ConfigError(f"OUT {out} holds a tokenizer.json, but the model reads UTF-8 bytes: a folder with both "
                          "is read with that tokenizer; choose a folder without one")


def copy_tokenizer_files(folder: Path | None, out: Path) -> list[str]:
    """Copy ``folder``'s TOKENIZER_FILES into the folder ``out`` (None: a byte-level model, nothing to copy); the
    names copied."""
    check_tokenizer_out(folder, out)
    if folder is None or folder.resolve() == out.resolve():
        return []
    copied = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    for name in copied:
        shutil.copyfile(folder / name, out / name)
    return copied
