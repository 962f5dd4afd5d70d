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
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from plait.plan.config import Layout
from plait.plan.model import Model

if TYPE_CHECKING:
    from plait.plan.memory import ActivationModel

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


def note(model: Model, layout: Layout) -> str:
    """The line a prediction's memory report carries under document masking: the attention path it counts."""
    from plait.documents import SPLIT_MAX
    from plait.plan.stages import layout_stages

    layers = max(layout_stages(model, layout).chunk_layers)
    path = document_bytes(model, layout, 4).path(layers)
    said = PATHS[path].format(n=SPLIT_MAX)
    if path == "cp":
        return f"--document-mask: counts the per-row RoPE tables; {said} keeps nothing more"
    return (f"--document-mask: counts {said}, the larger of the attention paths a micro-batch of "
            f"{layout.microbatch_size} x {model.seq_len} tokens can take (the data decides which it takes)")
