"""Raw text given straight to ``plait train --data`` (small inputs): tokenized in memory at start-up, the way
``plait data prepare`` tokenizes it. JSON lines, Parquet and ``datasets`` folders are refused with the
command that prepares them: their syntax is never trained on as text."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from plait.data.chat import no_messages_hint
from plait.data.encode import encode_documents
from plait.data.format import SPLITS, dtype_for
from plait.data.records import read_task
from plait.data.sources import BadRecord, Task, discover, tasks, where
from plait.data.sources import Source as Input
from plait.data.stream import RAW_HELD_OUT, MemorySplit, TrainSource
from plait.data.tokens import BYTES, TokenizerSpec
from plait.errors import ConfigError

STDLIB = "the Python standard library"


def default_paths() -> list[Path]:
    """The standard library's ``.py`` files (site-packages excluded), sorted by relative path."""
    root = sysconfig.get_paths()["stdlib"]
    found: list[str] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        rel = os.path.relpath(folder, root)
        found += [os.path.normpath(os.path.join(rel, n)) for n in names if n.endswith(".py")]
    return [Path(root, r) for r in sorted(r.replace(os.sep, "/") for r in found)]


def model_tokenizer(model: str) -> TokenizerSpec:
    """The tokenizer ``plait train --model`` reads: a folder's tokenizer.json, else UTF-8 bytes."""
    return TokenizerSpec(model if (Path(model) / "tokenizer.json").is_file() else BYTES)


def raw_inputs(path: str, model: str) -> list[Input]:
    """The plain text files under ``path``; ConfigError for JSON lines, Parquet or a ``datasets`` folder, with
    the command that prepares them."""
    found = discover([path], "--data")
    structured = [s for s in found if s.kind != "text"]
    if structured:
        s = structured[0]
        what = {"jsonl": "JSON lines", "parquet": "Parquet", "hf": "a Hugging Face datasets folder"}[s.kind]
        chat = " --chat" if s.kind == "jsonl" and holds_messages(s.files[0]) else ""
        raise ConfigError(f"--data {path}: {s.files[0]} is {what}, which plait trains on only once prepared (its "
                          f"text field alone, an EOS after each document): `plait data prepare {path} --tokenizer "
                          f"{model_tokenizer(model).source}{chat} --out DIR`, then --data DIR")
    return found


def holds_messages(path: Path) -> bool:
    """Whether a JSON-lines file's first record is a chat (a ``messages`` list): it is prepared with --chat."""
    with open(path, "rb") as f:
        line = next((raw for raw in f if raw.strip()), b"")
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and bool(no_messages_hint(record, "text"))


def raw_source(path: str | None, weight: float, model: str, max_mb: float) -> TrainSource:
    """Plain text files (``path``: a file or folder; None: the standard library's sources), one document each,
    read in order until ``max_mb`` million tokens, with the model's tokenizer and EOS."""
    spec = model_tokenizer(model)
    found = [Input(STDLIB, "text", default_paths())] if path is None else raw_inputs(path, model)
    tok = spec.load()
    try:
        eos = tok.eos(None)
    except ConfigError as exc:
        raise ConfigError(f"--data {path}: {exc}; or prepare the text with `plait data prepare ... --eos`") from None
    dtype = dtype_for(tok.vocab_size)
    parts: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    docs = {s: 0 for s in SPLITS}
    budget, size, files, skipped = int(max_mb * 1e6), 0, 0, 0
    for task in tasks(found, "text"):
        for name in task.files:  # one file at a time: the budget stops at a file's end
            one = Task(task.index, task.source, "text", name, files=[name])
            try:  # the standard library holds a few test files in other encodings: those are skipped
                got = read_task(one, "text", skip_bad=path is None)
            except BadRecord as rec:
                raise ConfigError(f"--data {path}: {where(rec)}: {rec.why}, or prepare the text with `plait data "
                                  "prepare ... --skip-bad` to leave such files out") from None
            files, skipped = files + 1, skipped + got.skipped
            for split, enc in encode_documents(got.docs, tok, eos, RAW_HELD_OUT, dtype).items():
                parts[split].append(enc.ids)
                docs[split] += len(enc.lengths)
                size += len(enc.ids)
            if size >= budget:
                break
        if size >= budget:
            break
    train, held = (np.concatenate(parts[s]) if parts[s] else np.zeros(0, dtype) for s in SPLITS)
    if len(train) == 0:  # every document (a single file, say) was held out: train on them, hold none out
        train, held, docs = held, held[:0], {"train": docs["held_out"], "held_out": 0}
    total = sum(len(s.files) for s in found)
    notes = [f"the first {files} of {total} files: --max-data-mb {max_mb:g}"] if files < total else []
    notes += [f"{skipped} of them left out (empty, binary or not UTF-8)"] if skipped else []
    note = "; ".join(notes)
    return TrainSource(path or STDLIB, weight, MemorySplit(train, docs["train"]), MemorySplit(held, docs["held_out"]),
                  prepared=False, files=files, note=note, eos=eos)
