"""Document masking's attention on a calibrated host: a layer's eager work (``census.Work``) as
``plait.documents.DocumentCore`` runs its core on the path ``plan.documents.masked_attention`` says, at the kernel
figures ``plait calibrate`` measured."""

from __future__ import annotations

from dataclasses import replace

from plait.plan.config import Layout
from plait.plan.documents import DocumentLengths, MaskedAttention, causal_share
from plait.plan.host import census

# Kernels each document alone adds to a layer, per row of the micro-batch: q, k and v split into its documents
# and its documents' outputs concatenated; per micro-batch: q, k and v split into rows, the rows concatenated.
ROW_OPS, MICROBATCH_OPS = 4, 4


def masked_work(work: census.Work, documents: DocumentLengths, masked: MaskedAttention, layout: Layout,
                sh: census.Local, dtype_bytes: int, device: str) -> census.Work:
    """``work`` of a layer with its attention core on ``masked``'s path (the calibration timed causal SDPA over
    whole rows, its FLOPs counted on the s×s square, at sizes keyed by s·d):

    - each document alone: the documents' share of those FLOPs at the figure for their length; a call of SDPA a
      document more than one a layer, and the splits and concatenations around them (``ROW_OPS``,
      ``MICROBATCH_OPS``), which copy the output forward (twice: each row's documents, then the rows) and the
      gradients of q, k and v backward (``split``'s backward concatenates them, twice);
    - the mask: the whole square where the causal kernel computed ``causal_share`` of it (on a CPU host torch's
      CPU kernel's blocks), and the additive mask read once forward and once backward: the kernel walks a row's
      heads one after another over the same [S, S] mask, which stays in the caches between them while it fits
      (S²·4 bytes a row in fp32: 4 MiB at 1,024 tokens; a longer row's mask read again for each head costs more
      than this counts). Building the mask, once a micro-batch for every layer of a chunk, is not charged.
    """
    if masked.path == "each":
        rows = layout.microbatch_size
        pieces = rows * documents.count
        copies = 2 * (2 * sh.q) + 2 * (2 * (sh.q + 2 * sh.k))  # elements read and written
        return replace(work, attention=work.attention * masked.share, attention_size=masked.seq * sh.head_dim,
                       elem_bytes=work.elem_bytes + copies * dtype_bytes,
                       ops=work.ops + pieces - 1 + ROW_OPS * rows + MICROBATCH_OPS)
    if masked.path == "mask":
        return replace(work, attention=work.attention / causal_share(sh.seq, device),
                       elem_bytes=work.elem_bytes + 2 * masked.mask / sh.heads)
    return work
