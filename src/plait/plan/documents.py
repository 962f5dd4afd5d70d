"""Memory of document masking (``plait train --document-mask``; ``plait.documents``): what autograd keeps for
one micro-batch beyond an unmasked step, on a chunk of layers.

A micro-batch whose rows hold several documents gets RoPE tables per row, [b, 1, s, hd] cos and sin (s = S/cp,
the rank's positions), in place of the one [s, hd] pair an unmasked step keeps for all its layers and micro-
batches (``ActivationModel.shared``). Without context parallelism its attention then takes one of two paths,
chosen by how many documents the micro-batch holds (``plait.documents.SPLIT_MAX``): up to that many, each
document's attention alone, which keeps one q-sized tensor [b, S, heads·hd/t] more per layer (none under selective
recomputation); more, one additive mask [b, 1, S, S] in the compute dtype, built once for the chunk's layers.
Under full recomputation a chunk saves only its checkpoints' inputs: the recomputed layer holds these. Under
context parallelism the blockwise cores read the documents' ids and keep nothing more. The data alone tells how
many documents a micro-batch holds, so the planner counts the larger of the paths that can occur (b·S tokens hold
at most b·S documents: no more than ``SPLIT_MAX``, no mask).

Time: ``DocumentLengths`` says how the data's documents cut the rows (how many a row holds, the sum of their
lengths squared), read from a prepared dataset's document index or assumed from a mean length, and
``CostModel.blocks`` costs a layer's attention core on the path they take (``attention_path``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.plan.config import Layout
    from plait.plan.memory import ActivationModel
    from plait.plan.model import Model

#: the attention paths, as ``DocumentBytes.path`` names them ({n}: ``plait.documents.SPLIT_MAX``)
PATHS = {"mask": "the mask [b, 1, S, S] (more than {n} documents in a micro-batch)",
         "each": "each document alone (up to {n} documents in a micro-batch)",
         "cp": "context parallelism's blockwise attention"}


@dataclass(frozen=True)
class DocumentBytes:
    """Bytes document masking adds to one micro-batch on a chunk: ``tables`` (the per-row RoPE tables), ``mask``
    (the mask path's, 0 where it cannot occur), ``layer`` (each document alone: per layer); ``pair`` is the
    shared RoPE pair the masked micro-batches no longer need (once per rank); ``blockwise``: context
    parallelism's attention, neither path."""

    tables: float
    mask: float
    layer: float
    pair: float
    blockwise: bool = False

    def path(self, layers: int) -> str:
        """Which path a chunk of ``layers`` layers is counted with (a key of ``PATHS``)."""
        if self.blockwise:
            return "cp"
        return "mask" if self.mask and self.mask >= layers * self.layer else "each"

    def chunk(self, layers: int) -> float:
        """Bytes one micro-batch keeps on a chunk of ``layers`` layers (none without a layer: no attention)."""
        return self.tables + max(self.mask, layers * self.layer) if layers else 0.0


def document_bytes(model: Model, layout: Layout, dtype_bytes: int) -> DocumentBytes:
    """What document masking adds under ``layout``, the compute dtype ``dtype_bytes`` bytes an element. Under
    selective recomputation the checkpointed core keeps its inputs (the mask among them), not what each document
    alone computes: that path keeps nothing a layer."""
    from plait.documents import SPLIT_MAX  # torch's module: only a run with document masking gets here

    b, s = layout.microbatch_size, model.seq_len
    local = s / layout.cp
    pair = 2 * local * model.head_dim * dtype_bytes
    if layout.cp > 1:
        return DocumentBytes(b * pair, 0.0, 0.0, pair, blockwise=True)
    mask = b * s * s * dtype_bytes if b * s > SPLIT_MAX else 0.0
    each = 0.0 if layout.recompute == "selective" else b * s * model.q_width / layout.tp * dtype_bytes
    return DocumentBytes(b * pair, mask, each, pair)


def with_documents(acts: ActivationModel, model: Model, layout: Layout, dtype_bytes: int) -> ActivationModel:
    """``acts`` with document masking's bytes: per micro-batch in flight, its per-row tables in place of the
    shared pair; under full recomputation, where a chunk saves only its checkpoints' inputs, held once by the
    recomputed layer (its working set)."""
    docs = document_bytes(model, layout, dtype_bytes)
    if layout.recompute == "full":
        return replace(acts, working=acts.working + docs.chunk(1) - docs.pair)
    return replace(acts, documents=docs, shared=max(0.0, acts.shared - docs.pair))


def note(model: Model, layout: Layout, documents: DocumentLengths | None = None) -> str:
    """The line a prediction's memory report carries under document masking: the attention path its memory counts,
    and the one its step time costs with the documents' lengths (``documents``; None: costed as without)."""
    from plait.documents import SPLIT_MAX
    from plait.plan.stages import layout_stages

    layers = max(layout_stages(model, layout).chunk_layers)
    path = document_bytes(model, layout, 4).path(layers)
    said = PATHS[path].format(n=SPLIT_MAX)
    if path == "cp":
        line = f"--document-mask: counts the per-row RoPE tables; {said} keeps nothing more"
    else:
        line = (f"--document-mask: counts {said}, the larger of the attention paths a micro-batch of "
                f"{layout.microbatch_size} x {model.seq_len} tokens can take (the data decides which it takes)")
    if documents is None:
        return f"{line}; its step time is costed as without the mask (the documents' lengths are not known)"
    timed = attention_path(documents, layout)
    return (f"{line}; its step time costs {PATHS[timed].format(n=SPLIT_MAX)}, {documents.count:,.1f} documents a "
            f"row of {documents.length:,.0f} tokens (root mean square) on average: {documents.source}")


@dataclass(frozen=True)
class DocumentLengths:
    """The documents of a run's packed rows, as document masking's step time needs them: on average over its rows
    of ``seq_len`` tokens, ``count`` documents (a document cut by a row's ends counts once in each row it is in)
    and ``squares``, the sum of their lengths squared; ``source`` says where they come from (``Training.documents``:
    "plait train --dry-run" reads them from its data, ``plait plan`` assumes a mean length)."""

    seq_len: int
    count: float
    squares: float
    source: str

    def __post_init__(self) -> None:
        s = self.seq_len
        if not (s >= 1 and 1 <= self.count <= s and s <= self.squares * (1 + 1e-9) and self.squares <= s * s * (
                1 + 1e-9)):
            raise ConfigError(f"documents: {self.count!r} documents a row with squares summing to {self.squares!r} "
                              f"cannot cut rows of {s} tokens (1 to {s} documents; squares from {s} to {s * s})")

    @classmethod
    def of_mean(cls, mean: float, seq_len: int) -> DocumentLengths:
        """Every document ``mean`` tokens long (its end-of-document token included), the rows cut from the packed
        stream at any offset: a document of L tokens is in L + S - 1 of the windows of S tokens that overlap it,
        its pieces there squared summing to ``piece_squares(L, S)``, and a row holds S/L documents' worth."""
        if not (isinstance(mean, int | float) and mean >= 1):
            raise ConfigError(f"mean_document_length: {mean!r}; give the tokens a document averages (its "
                              "end-of-document token included), >= 1")
        return cls(seq_len, (mean + seq_len - 1) / mean, piece_squares(mean, seq_len) / mean,
                   f"documents of {mean:,g} tokens assumed")

    @property
    def length(self) -> float:
        """The root mean square of a row's documents' lengths: the length their attention runs at."""
        return math.sqrt(self.squares / self.count)


def check_documents(document_mask: bool, documents: object) -> None:
    """ConfigError unless ``Training.documents`` is None or, with ``document_mask``, a ``DocumentLengths``."""
    if documents is not None and not (document_mask and isinstance(documents, DocumentLengths)):
        raise ConfigError(f"documents: {documents!r}; give a plan.documents.DocumentLengths with document_mask=True, "
                          "or None")


def piece_squares(length: float, seq_len: float) -> float:
    """The overlap squared of a document of ``length`` tokens with each window of ``seq_len`` tokens that overlaps
    it in a packed stream, summed over them: with a = min(L, S) and b = max(L, S), overlaps 1 .. a-1 as a window
    slides in and again as it slides out, and a for the b - a + 1 windows between."""
    a, b = min(length, seq_len), max(length, seq_len)
    return (a - 1) * a * (2 * a - 1) / 3 + (b - a + 1) * a * a


def attention_path(lengths: DocumentLengths, layout: Layout) -> str:
    """The path (a key of ``PATHS``) a micro-batch of ``layout`` takes with documents as ``lengths`` cut the rows:
    context parallelism's blockwise attention under cp > 1; else each document alone while the micro-batch holds
    no more than ``plait.documents.SPLIT_MAX`` documents on average, the mask past that."""
    from plait.documents import SPLIT_MAX  # torch's module: only a run with document masking gets here

    if layout.cp > 1:
        return "cp"
    return "each" if layout.microbatch_size * lengths.count <= SPLIT_MAX else "mask"


def causal_share(seq_len: float, device: str = "cuda") -> float:
    """The share of the s×s square of scores a causal fused kernel computes, where an additive mask makes it
    compute all of it. On a GPU (FlashAttention-2, Dao 2023, §3.1.1; cuDNN's alike) the blocks above the diagonal
    are skipped: about half. torch's CPU kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp,
    ``cpu_flash_attention``, forward and backward alike) cuts the queries into blocks of 256 rows from 768 tokens
    on, 64 from 192, else 32, and computes for each the key blocks of 512 up to the block's last query: at 512
    tokens all of the square, at 1024 three quarters, at 2048 five eighths."""
    s = int(seq_len)
    if device != "cpu":
        return 0.5
    rows = 256 if s >= 768 else 64 if s >= 192 else 32
    keys = sum(min(rows, s - m) * min(-(-min(m + rows, s) // 512) * 512, s) for m in range(0, s, rows))
    return keys / (s * s)


def mask_bytes(model: Model, layout: Layout, dtype_bytes: int) -> float:
    """Bytes of the mask path's additive mask [b, 1, S, S] one pass of a layer's attention reads: the kernel adds
    it to each head's scores (its rank's heads), reading it again for each."""
    return layout.microbatch_size * model.n_heads / layout.tp * model.seq_len ** 2 * dtype_bytes


@dataclass(frozen=True)
class MaskedAttention:
    """A layer's attention core under document masking, as the cost models charge it (``masked_attention``):
    ``path`` (a key of ``PATHS``; None without masking), ``share`` of the unmasked work its scores take (each
    document alone: their squares over the rows'), the sequence length its kernel runs at (``seq``), and
    ``mask``, the bytes one pass reads of the mask path's additive mask (0 on the other paths)."""

    path: str | None
    share: float
    seq: float
    mask: float


def masked_attention(documents: DocumentLengths | None, model: Model, layout: Layout,
                     dtype_bytes: int) -> MaskedAttention:
    """How ``documents`` (None: no masking, or lengths unknown) make a layer's attention under ``layout`` run, the
    compute dtype ``dtype_bytes`` bytes an element. Each document alone: ``plait.documents.DocumentCore._each``
    runs the module's causal core on each document's slice, so the scores' work falls from the row's S² to the
    sum of its documents' squares, at the kernel's speed for their length (``DocumentLengths.length``). The mask:
    one call over the whole rows with an additive mask, which the fused kernels take only as a dense mask: every
    block of the S×S square is computed (``causal_share`` of it was), and the mask is read with each head's
    scores (``mask_bytes``). Context parallelism's blockwise cores skip only the score tiles no query sees: charged
    as without the mask."""
    if documents is not None and documents.seq_len != model.seq_len:
        raise ConfigError(f"documents: lengths of rows of {documents.seq_len} tokens, for a model of seq_len "
                          f"{model.seq_len}; give the DocumentLengths of its rows")
    s = model.seq_len / layout.cp
    path = None if documents is None else attention_path(documents, layout)
    if path == "each" and documents is not None:
        return MaskedAttention(path, documents.squares / model.seq_len ** 2, documents.length, 0.0)
    if path == "mask":
        return MaskedAttention(path, 1.0, s, mask_bytes(model, layout, dtype_bytes))
    return MaskedAttention(path, 1.0, s, 0.0)
