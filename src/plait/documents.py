"""Document masking of packed samples, applied from outside the model: attention stays inside each document.

``plait data prepare`` packs documents, an end-of-document token (EOS) after each, into samples of a fixed
length, so one sample may hold the end of one document, several whole ones and the start of another. With
document masking (``plait train --document-mask``; ``plait.parallelize(..., document_eos=EOS)``) a token
attends only to the earlier tokens of its own document, as if each document were run alone:

- A document is a run of tokens that ends with an EOS (included) or at the end of the sample; the token after
  an EOS starts the next one (Megatron-LM's ``--reset-attention-mask``).
- Positions restart at 0 at each document (Megatron-LM's ``--reset-position-ids``), with the mask, not as a
  switch of their own: with rotary embeddings a score depends only on the distance between query and key, so
  under the mask restarting positions changes nothing but rounding, and without the mask it would make tokens
  of two documents look close that are not.
- The target after an EOS (the next document's first token, predicted from the end of another document) is
  left out of the loss (Megatron-LM's ``--eod-mask-loss``): a document's loss is then exactly its loss run
  alone, and the mean is over the remaining targets.

A micro-batch whose rows each hold one document runs attention unchanged (SDPA's ``is_causal``). One of at most
``split_max`` documents (``SPLIT_MAX``) runs each document's attention alone: the module's core on that
document's slice of q, k, v (causal, with the module's own mask, a sliding window, sliced to it), the scores
of a document ``L`` tokens long ``L²/2`` where the whole row's causal square is ``S²/2``. One of more documents
(where so many small calls would cost more than they save) gets one additive mask [b, 1, S, S] (causal and same
document, one tensor per micro-batch shared by the layers) ANDed with the module's mask. The module's ``rope``
gives the per-row positions either way. Under context parallelism the CP cores read the document ids of any block of
keys from the full rows every CP rank holds (nothing more is sent) and skip score tiles no query sees.

The executor (plait.pipeline.executor) calls ``Documents.use(mb)`` before every forward and backward of
micro-batch ``mb``, so a later pipeline stage, and a block recomputed during its backward, see that micro-
batch's documents without any of it crossing a pipeline link.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plait.context_parallel.layout import local_positions
from plait.errors import ConfigError
from plait.models.family import attention_methods

Tables = tuple[torch.Tensor, torch.Tensor]
Spans = list[list[tuple[int, int]]]  # per row of a micro-batch, its documents' [start, end) token ranges
#: documents in a micro-batch up to which each one's attention runs alone (more: one mask for the micro-batch)
SPLIT_MAX = 64


def document_ids(tokens: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index, position within the document) of every token of ``tokens`` [B, S], both [B, S] int64:
    a token after an EOS starts a new document."""
    b, s = tokens.shape
    start = torch.zeros_like(tokens, dtype=torch.bool)
    start[:, 1:] = tokens[:, :-1] == eos  # [B, S] True where a document starts (the first token aside)
    ids = start.long().cumsum(1)
    index = torch.arange(s, device=tokens.device).expand(b, s)
    first = torch.where(start, index, torch.zeros_like(index)).cummax(1).values  # [B, S] where each one starts
    return ids, index - first


class Documents:
    """The documents of the micro-batch being run, for the attention modules of one ParallelModel (``eos`` None:
    no document masking; ``mask_targets`` and ``start`` then change nothing).

    ``ids`` [b, S]: each token's document in its (full) row; ``positions`` [b, S/cp]: this CP rank's tokens'
    positions within their documents; ``mask()`` [b, 1, S, S]: causal and same document. They are None for a
    micro-batch whose rows each hold a single document (attention then runs as without masking).
    """

    def __init__(self, eos: int | None, microbatches: int = 1, device: torch.device | None = None, cp: int = 1,
                 cp_rank: int = 0, split_max: int | None = None):
        self.eos, self.microbatches, self.device = eos, microbatches, device
        self.cp, self.cp_rank = cp, cp_rank
        self.split_max = SPLIT_MAX if split_max is None else split_max
        self.ids: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.spans: Spans | None = None  # the documents, when each one's attention runs alone (cp = 1)
        self._mask: torch.Tensor | None = None
        self._batches: list[tuple[torch.Tensor, torch.Tensor, Spans | None] | None] = []

    def mask_targets(self, inputs: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """``targets`` with the target after each EOS of ``inputs`` (the next document's first token) ignored."""
        if self.eos is None:
            return targets
        return targets.masked_fill(inputs.to(targets.device) == self.eos, ignore_index)

    def start(self, inputs: torch.Tensor) -> Callable[[int | None], None] | None:
        """Work out the documents of a step's full rows ``inputs`` [B, S], split into its micro-batches (one host
        read: where documents end); returns ``use`` (None without masking)."""
        if self.eos is None:
            return None
        inputs = inputs.to(self.device)
        b, s = inputs.shape
        cuts: list[list[int]] = [[0] for _ in range(b)]
        for row, at in (inputs[:, :-1] == self.eos).nonzero().tolist():
            cuts[row].append(at + 1)
        spans = [list(zip(c, [*c[1:], s], strict=True)) for c in cuts]
        self._batches = []
        for rows, part in zip(inputs.chunk(self.microbatches), _chunks(spans, self.microbatches), strict=True):
            n = sum(len(row) for row in part)
            split = part if self.cp == 1 and n <= self.split_max else None
            self._batches.append((*document_ids(rows, self.eos), split) if n > len(part) else None)
        return self.use

    def use(self, microbatch: int | None) -> None:
        """Make micro-batch ``microbatch``'s documents the ones attention sees (None: none, as after a step)."""
        docs = None if microbatch is None else self._batches[microbatch]
        if docs is None:
            self.ids = self.positions = self._mask = self.spans = None
            return
        ids, positions, spans = docs
        if self.ids is ids:
            return
        if self.cp > 1:
            positions = positions[:, local_positions(ids.shape[1] // self.cp, self.cp, self.cp_rank, ids.device)]
        self.ids, self.positions, self.spans, self._mask = ids, positions, spans, None

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[b, 1, S, S] additive mask in ``dtype``: 0 where query i sees key j (j <= i in the same document), -inf
        elsewhere. Built once per micro-batch and handed to every layer: SDPA keeps this tensor for its backward,
        one for all layers, where a boolean mask would be converted (and kept) anew in each layer."""
        assert self.ids is not None, "only with several documents in the micro-batch"
        if self._mask is None or self._mask.dtype != dtype:
            s = self.ids.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=self.ids.device).tril()
            seen = (causal & (self.ids[:, :, None] == self.ids[:, None, :]))[:, None]
            self._mask = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, -torch.inf)
        return self._mask

    def pair(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The document ids [b, Sq], [b, Sk] of queries and keys at global positions ``q_pos``, ``k_pos`` (None:
        one document per row)."""
        return None if self.ids is None else (self.ids[:, q_pos], self.ids[:, k_pos])


def _chunks(rows: list, n: int) -> list[list]:
    """``rows`` cut as ``torch.chunk`` cuts a batch into ``n`` micro-batches."""
    size = -(-len(rows) // n)
    return [rows[i:i + size] for i in range(0, len(rows), size)]


WHOLE_SEQUENCES = ("document masking runs training and evaluation over whole packed samples, not decoding with "
                   "a KV cache")


class DocumentRope:
    """Shadows ``rope(seq_len, offset, dtype)``: with several documents, the tables of the per-row positions
    within each document (``rope_at``), else the module's own (or context parallelism's) ``rope``."""

    def __init__(self, rope: Callable[[int, int, torch.dtype], Tables],
                 rope_at: Callable[[torch.Tensor, torch.dtype], Tables], documents: Documents):
        self.rope, self.rope_at, self.documents = rope, rope_at, documents

    def __call__(self, seq_len: int, offset: int, dtype: torch.dtype) -> Tables:
        positions = self.documents.positions
        if positions is None:
            return self.rope(seq_len, offset, dtype)
        if offset or positions.shape[1] != seq_len:
            raise ConfigError(WHOLE_SEQUENCES)
        return self.rope_at(positions, dtype)  # [b, 1, S, hd]


class DocumentCore:
    """Shadows ``core(q, k, v, mask, causal)``: with several documents, the module's own core on each document
    alone (``Documents.spans``) or under the document mask ANDed with the module's mask; else the module's core
    as it is."""

    def __init__(self, core: Callable[..., torch.Tensor], documents: Documents):
        self.core, self.documents = core, documents

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 causal: bool = True) -> torch.Tensor:
        if self.documents.ids is None:
            return self.core(q, k, v, mask, causal)
        if not causal or k.shape[2] != q.shape[2]:
            raise ConfigError(WHOLE_SEQUENCES)
        if self.documents.spans is not None:
            return self._each(q, k, v, mask, self.documents.spans)
        same = self.documents.mask(q.dtype)  # [b, 1, S, S] additive
        return self.core(q, k, v, same if mask is None else same.masked_fill(~mask, -torch.inf), True)

    def _each(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              spans: Spans) -> torch.Tensor:
        """Each document's attention alone, in place of its tokens: [b, h, S, hd]. q, k and v are cut with
        ``split`` (rows, then each row's documents), whose backward concatenates the pieces' gradients once; a
        slice per document (``q[r:r+1, :, a:e]``) would give each document a zero-filled gradient of the whole
        tensor in the backward, summed with the others: traffic growing with the number of documents."""
        rows = []
        cuts = [[e - a for a, e in row] for row in spans]
        for r, (qr, kr, vr) in enumerate(zip(*(x.split(1) for x in (q, k, v)), strict=True)):
            pieces = zip(*(x.split(cuts[r], 2) for x in (qr, kr, vr)), spans[r], strict=True)
            parts = [self.core(qd, kd, vd, None if mask is None else mask[..., a:e, a:e], True)
                     for qd, kd, vd, (a, e) in pieces]
            rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, 2))
        return rows[0] if len(rows) == 1 else torch.cat(rows, 0)


def apply_documents(modules: dict[str, nn.Module], documents: Documents, cp: int, model_name: str = "model") -> int:
    """Make every attention module in ``modules`` (name -> module) attend within documents; returns how many.
    Its ``rope`` is shadowed; with cp = 1 its ``core`` too (the CP cores read ``documents`` themselves, given
    by ``apply_context_parallel``)."""
    if not modules:
        raise ConfigError(f"document_eos: {model_name}'s family adapter names no attention modules to mask; leave "
                          "document masking off")
    for name, module in modules.items():
        methods = attention_methods(name, module, "document_eos: attention module {name} has no {method}() to mask "
                                                  "documents with; leave document masking off")
        setattr(module, "rope", DocumentRope(methods["rope"], methods["rope_at"], documents))  # noqa: B010
        if cp == 1:
            setattr(module, "core", DocumentCore(methods["core"], documents))  # noqa: B010
    return len(modules)
