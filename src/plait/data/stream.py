"""What ``plait train`` reads: one or more weighted sources as ``seq_len + 1``-token windows, batch by batch.

Source ``i``'s training stream (documents, each followed by EOS, packed) is cut into windows
``[w·S, w·S + S + 1)`` for ``w < (tokens - 1) // S``: inputs are the first ``S`` tokens, targets the last
``S``, those outside a chat dataset's loss mask (the user's turns, say) set to ``IGNORE``. Global sample ``g``
of the run is the window ``plait.data.order.Order`` assigns it; batch ``k`` is samples ``F + k·B .. F + k·B + B - 1``
(``F = 0`` in a fresh run; a resumed run sets it so that its first batch starts at the first sample its checkpoint
had not read, whatever batch size either run has) and a data-parallel replica reads only its own rows of it.
Sources are
prepared datasets (memory-mapped: only the windows read are paged in) or, for small inputs, plain text
files tokenized in memory the way ``plait data prepare`` would.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from plait.data.format import TokenSplit, is_prepared, open_prepared
from plait.data.order import Order
from plait.data.tokens import BYTES, model_fingerprint
from plait.errors import ConfigError
from plait.words import counted

RAW_HELD_OUT = 0.1  # share of the documents of raw text held out (a prepared dataset says its own)
PROMPT_TOKENS = 8  # tokens of a text document that prompt the sample drawn at a run's end
EVAL_BATCHES = 2  # held-out batches per evaluation (the same batches every time)
IGNORE = -100  # a target outside the loss mask: the losses' ignore_index (plait.parallelization.TokenLoss)
_WEIGHTED = re.compile(r"^([-+]?(?:\d+(?:\.\d*)?|\.\d+)):(.+)$")


class MemorySplit:
    """A split held in memory (raw text tokenized at start-up): the interface of ``format.Split``."""

    masked = False

    def __init__(self, ids: np.ndarray, documents: int):
        self.ids, self.tokens, self.documents = ids, len(ids), documents

    def read(self, start: int, length: int) -> np.ndarray:
        return np.array(self.ids[start:start + length])

    def read_mask(self, start: int, length: int) -> np.ndarray:
        return np.ones(length, dtype=np.uint8)

    def first_document_end(self) -> int | None:
        return None  # no document index: text documents end at their first EOS


@dataclass
class TrainSource:
    """One ``--data`` entry: its weight and its two splits."""

    name: str
    weight: float
    train: TokenSplit  # format.Split (memory-mapped) or MemorySplit
    held_out: TokenSplit
    prepared: bool
    files: int = 0
    note: str = ""  # what else the summary says of it (a chat dataset's loss mask)
    eos: int | None = None  # the end-of-document token after each of its documents


@dataclass
class TrainData:
    """The run's data: sources, window length, batch size and seed; batches of any step, any rows."""

    sources: list[TrainSource]
    seq_len: int
    batch_size: int
    seed: int
    order: Order = field(init=False)
    eval_order: Order | None = field(init=False)
    # a resumed run whose checkpoint saw other batches than this run's would have: (its step, the input tokens
    # and the passes over each source it had seen); None: the counts follow from this run's settings alone
    carried: tuple[int, int, list[float]] | None = field(default=None, init=False)
    # global sample of batch 0's first row: 0, or set by ``resume_at`` to (samples the checkpoint's run had read)
    # - step × batch_size, so batch ``step`` reads on from there (negative when this batch size is the larger)
    first: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        S = self.seq_len
        for s in self.sources:
            check_length(s, S)
        self.order = Order(tuple((s.train.tokens - 1) // S for s in self.sources),
                           tuple(s.weight for s in self.sources), self.seed)
        held = [s for s in self.sources if (s.held_out.tokens - 1) // S >= 1]
        self._held = held
        #: sources with held-out tokens but not one window of them: no part of the held-out loss
        self.short_held_out = [s for s in self.sources if s.held_out.tokens and s not in held]
        self.eval_order = Order(tuple((s.held_out.tokens - 1) // S for s in held), tuple(s.weight for s in held),
                                self.seed, stream=1) if held else None

    def _rows(self, order: Order, splits: list, g: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets [rows, S]; a target outside its source's loss mask is IGNORE."""
        source, _, window = order.locate(g)
        S = self.seq_len
        rows = np.stack([splits[s].read(int(w) * S, S + 1) for s, w in zip(source, window, strict=True)])
        tokens = torch.from_numpy(rows.astype(np.int64))  # [rows, S+1]
        targets = tokens[:, 1:].contiguous()
        if any(splits[s].masked for s in set(source.tolist())):
            mask = np.stack([splits[s].read_mask(int(w) * S + 1, S) for s, w in zip(source, window, strict=True)])
            targets.masked_fill_(torch.from_numpy(mask == 0), IGNORE)
        return tokens[:, :-1].contiguous(), targets

    def batch(self, step: int, part: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``part = (index, count)`` of global batch ``step``: inputs and targets [B/count, S] (int64)."""
        index, count = part
        rows = self.batch_size // count
        g = self.samples(step) + np.arange(index * rows, (index + 1) * rows, dtype=np.int64)
        return self._rows(self.order, [s.train for s in self.sources], g)

    def samples(self, steps: int) -> int:
        """Global samples read after ``steps`` steps (the first sample of batch ``steps``)."""
        return self.first + steps * self.batch_size

    def held_out_batch(self, i: int, part: tuple[int, int] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows ``part`` of held-out batch ``i`` (the same windows every evaluation); None without a held-out
        split at least one window long."""
        if self.eval_order is None:
            return None
        index, count = part
        rows = self.batch_size // count
        g = i * self.batch_size + np.arange(index * rows, (index + 1) * rows, dtype=np.int64)
        return self._rows(self.eval_order, [s.held_out for s in self._held], g)

    def resume_at(self, step: int, saved: dict, same_data: bool) -> None:
        """Read on from a checkpoint's metadata ``saved`` at ``step``: batch ``step`` starts at the first sample
        its run had not read (``samples`` of its counts; a checkpoint without it read ``step`` batches of its own
        --batch-size), so a resumed run with another --batch-size neither skips nor repeats a sample of the
        order. Tokens and passes count on from those its run had seen (under its own --seq-len, which may differ
        from this run's: then the windows, and so the order, differ). A checkpoint without those counts gives
        them from its run's batch size and window length; passes over other --data than this run's are not this
        data's, which is counted from the samples read."""
        counts, train = saved.get("data") or {}, saved.get("train") or {}
        size, length = train.get("batch_size", self.batch_size), train.get("seq_len", self.seq_len)
        read = int(counts.get("samples", step * size))
        self.first = read - step * self.batch_size
        tokens = counts.get("tokens_seen", read * length)
        if same_data and tokens == read * self.seq_len:
            return  # the counts follow from the samples read
        names = [s.name for s in self.sources]
        if not same_data:
            epochs = [0.0] * len(names)
        elif set(counts.get("epochs", {})) == set(names):
            epochs = [counts["epochs"][n] for n in names]
        elif "epoch" in counts and len(names) == 1:
            epochs = [counts["epoch"]]
        else:  # the passes of the saved run's windows
            epochs = Order(tuple((s.train.tokens - 1) // length for s in self.sources),
                           tuple(s.weight for s in self.sources), self.seed).epochs(read)
        self.carried = (step, int(tokens), epochs)

    def position(self, steps: int) -> dict:
        """After ``steps`` steps: ``tokens_seen`` (input tokens), ``epoch`` (passes over the data: the most of
        any source's), and ``epochs`` per source when there are several; counted on from a resumed checkpoint's
        counts when its run read other windows (``resume_at``)."""
        samples = self.samples(steps)
        epochs = self.order.epochs(samples)
        tokens = samples * self.seq_len
        if self.carried is not None:
            step, before, then = self.carried
            tokens = before + (steps - step) * self.batch_size * self.seq_len
            epochs = [e + now - at for e, now, at in zip(then, epochs, self.order.epochs(self.samples(step)),
                                                         strict=True)]
        out: dict = {"epoch": round(max(epochs), 4), "tokens_seen": tokens}
        if len(self.sources) > 1:
            out["epochs"] = {s.name: round(e, 4) for s, e in zip(self.sources, epochs, strict=True)}
        return out

    def saved_counts(self, steps: int) -> dict:
        """What a checkpoint after ``steps`` steps keeps of the data (``resume_at`` reads it): ``position`` and
        the global samples read."""
        return {**self.position(steps), "samples": self.samples(steps)}

    def prompt(self, limit: int) -> list[int]:
        """The start of a document to prompt a sample with: the first chat source's (else the first source's)
        first held-out document (the first training one when nothing is held out). A conversation is cut before
        its first token in the loss, so the prompt is its opening turns up to the assistant's header and the
        sample is the model's reply; text (or a conversation with no such token in its first ``limit`` tokens)
        gives its first ``PROMPT_TOKENS`` tokens."""
        source = next((s for s in self.sources if s.train.masked), self.sources[0])
        split = source.held_out if source.held_out.tokens > 1 else source.train
        n = min(limit, split.tokens)
        ids, mask = split.read(0, n).tolist(), split.read_mask(0, n)
        # the first document's end (its EOS left out): the index knows it, where a chat template may end every
        # turn with the EOS token too (ChatML's <|im_end|>); else the first EOS
        end = split.first_document_end()
        eos = min(end - 1, n) if end is not None else ids.index(source.eos) if source.eos in ids else n
        first = int(np.argmax(mask[:eos])) if split.masked and mask[:eos].any() else 0
        return ids[:first] if first > 0 else ids[:min(PROMPT_TOKENS, max(1, eos))]

    @property
    def eos(self) -> int | None:
        """The end-of-document token every source ends its documents with (None when they differ)."""
        ends = {s.eos for s in self.sources}
        return ends.pop() if len(ends) == 1 else None

    def document_eos(self, wanted: bool) -> int | None:
        """The end-of-document token that document masking (``--document-mask``) cuts documents at, if ``wanted``:
        ConfigError when the sources have no one such token, or when a source's first document holds it before its
        end (a chat template that ends each turn with it: masking would cut conversations apart)."""
        if not wanted:
            return None
        eos = self.eos
        if eos is None:
            ends = ", ".join(f"{s.name}: {s.eos if s.eos is not None else 'none recorded'}" for s in self.sources)
            raise ConfigError(f"--document-mask: the --data sources have no one end-of-document token ({ends}); "
                              "prepare them with one --eos, or leave --document-mask off")
        for s in self.sources:
            end = s.train.first_document_end()
            if end is not None and eos in s.train.read(0, end - 1).tolist():
                raise ConfigError(f"--document-mask: {s.name}'s documents hold its end-of-document token {eos} "
                                  "inside them (a chat template ending each turn with it), so masking at it would "
                                  "cut them apart; leave --document-mask off for this data")
        return eos

    def describe(self, document_mask: bool = False) -> str:
        """One line: the sources, their weights and sizes (and, with ``document_mask``, where documents end)."""
        parts = []
        for s in self.sources:
            weight = f"{s.weight / sum(x.weight for x in self.sources):.0%} " if len(self.sources) > 1 else ""
            kind = "prepared" if s.prepared else f"{counted(s.files, 'file')}, tokenized here"
            note = f"; {s.note}" if s.note else ""
            short = (f", fewer than one {self.seq_len + 1:,}-token window: no held-out loss"
                     if s in self.short_held_out else "")
            parts.append(f"{weight}{s.name} ({kind}: {_tokens(s.train.tokens)} training tokens, "
                         f"{_tokens(s.held_out.tokens) if s.held_out.tokens else 'none'} held out{short}{note})")
        masked = [f"attention within documents (EOS {self.eos})"] if document_mask else []
        return "; ".join(parts + masked)


def _tokens(n: int) -> str:
    """A number of tokens as the data line shows it: in millions from 0.1M, else in full (a small source's
    1,234 tokens would read 0.00M)."""
    return f"{n / 1e6:.2f}M" if n >= 100_000 else f"{n:,}"


def check_length(source: TrainSource, seq_len: int) -> None:
    """ConfigError with the counts when the training split holds no ``seq_len + 1``-token window."""
    split = source.train
    if (split.tokens - 1) // seq_len < 1:
        raise ConfigError(f"--data {source.name}: {counted(split.tokens, 'training token')} in "
                          f"{counted(split.documents, 'document')}, "
                          f"but --seq-len {seq_len} needs at least {seq_len + 1} tokens for one window")


def check_entries(entries: list[str], model: str, vocab_size: int, seq_len: int, document_mask: bool = False) -> None:
    """What can be checked before launch, cheaply: weights and paths; a prepared dataset's tokenizer, vocabulary
    and length; raw inputs that must be prepared first; with ``document_mask``, prepared datasets' end-of-document
    token (``TrainData.document_eos``: the workers check it again with raw text among them)."""
    from plait.data.raw import raw_inputs

    check_distinct(entries)
    prepared = []
    for entry in entries:
        weight, path = parse_entry(entry)
        if not Path(path).exists():
            raise ConfigError(f"--data {entry}: no such file or directory")
        if is_prepared(path):
            prepared.append(prepared_source(path, weight, model, vocab_size))
            check_length(prepared[-1], seq_len)
        elif not sum(s.bytes for s in raw_inputs(path, model)):
            raise ConfigError(f"--data {entry}: no text there (empty files, or a folder without files)")
    if document_mask and prepared and len(prepared) == len(entries):
        TrainData(prepared, seq_len, 1, 0).document_eos(True)


def check_distinct(entries: list[str]) -> None:
    """ConfigError when two ``--data`` entries name the same data (the same path, however written, with any
    weights): each source runs through its own epochs and is counted under its name, so the same data twice
    would be two sources with one name; its weight says how much of the mixture it is."""
    seen: dict[Path, str] = {}
    weights = "with its share of the mixture as its weight (e.g. --data 0.7:web --data 0.3:code)"
    for entry in entries:
        key = Path(parse_entry(entry)[1]).resolve()
        if key in seen:
            raise ConfigError(f"--data {entry}: names the same data as --data {seen[key]}; give each source once, "
                              + weights)
        for other, named in seen.items():  # a folder's files are all read, those in its sub-folders too
            if other in key.parents or key in other.parents:
                inner, outer = (entry, named) if other in key.parents else (named, entry)
                raise ConfigError(f"--data {inner}: is inside the folder --data {outer}, which reads it too; give "
                                  "each file once (a folder without it, and it on its own), each " + weights)
        seen[key] = entry


def parse_entry(entry: str) -> tuple[float, str]:
    """``"0.7:web"`` -> (0.7, "web"); a plain path (even one with a colon that exists) -> (1.0, path)."""
    m = _WEIGHTED.match(entry)
    if m is None or Path(entry).exists():
        return 1.0, entry
    weight = float(m.group(1))
    if not weight > 0:
        raise ConfigError(f"--data {entry}: the weight must be > 0")
    return weight, m.group(2)


def open_data(entries: list[str], model: str, vocab_size: int, seq_len: int, batch_size: int, seed: int,
              max_mb: float) -> TrainData:
    """The sources of ``--data`` (none: the Python standard library's sources), checked against the model's
    tokenizer and vocabulary."""
    from plait.data.raw import raw_source

    if not entries:
        return TrainData([raw_source(None, 1.0, model, max_mb)], seq_len, batch_size, seed)
    check_distinct(entries)
    sources = []
    for entry in entries:
        weight, path = parse_entry(entry)
        if is_prepared(path):
            sources.append(prepared_source(path, weight, model, vocab_size))
        else:
            sources.append(raw_source(path, weight, model, max_mb))
    return TrainData(sources, seq_len, batch_size, seed)


def prepared_source(path: str, weight: float, model: str, vocab_size: int) -> TrainSource:
    """A prepared dataset, refused when its tokenizer is not the model's or its ids do not fit the model."""
    ds = open_prepared(path)
    tok = ds.tokenizer
    fingerprint, name = model_fingerprint(model)
    again = model if fingerprint != BYTES else BYTES
    if tok["fingerprint"] != fingerprint:
        raise ConfigError(f"--data {path} was prepared with {tok['name']} (fingerprint {tok['fingerprint']}, "
                          f"vocabulary {tok['vocab_size']:,}), but --model {model} reads {name} (fingerprint "
                          f"{fingerprint}): prepare it again with --tokenizer {again}"
                          + (f", or give --model a model folder (config.json) whose tokenizer.json is "
                             f"{tok['name']}'s" if tok["fingerprint"] != BYTES else ""))
    if tok["vocab_size"] > vocab_size:
        raise ConfigError(f"--data {path}: its tokenizer's vocabulary {tok['vocab_size']:,} exceeds --model {model}'s "
                          f"vocab_size {vocab_size:,}")
    chat = ds.meta.get("chat")
    note = ""
    if chat is not None:
        train = ds.meta["splits"]["train"]
        share = train["loss_tokens"] / max(1, train["tokens"])
        note = f"chat: the loss on {chat['loss_on']} tokens, {share:.0%} of them"
    return TrainSource(path, weight, ds.train, ds.held_out, prepared=True, note=note, eos=tok.get("eos"))
