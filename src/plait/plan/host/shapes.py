"""The shapes ``plait calibrate`` times on a host: real decoder layers, tensor-parallel layers and pipelines."""

from __future__ import annotations

from plait.plan.host.census import Local
from plait.plan.model import llama_ffn

# Real decoder layers ``plait calibrate`` times forward + backward (plait.models.llama.DecoderLayer, unsharded):
# (batch, sequence, hidden, heads, kv heads), Llama's FFN rule. A tiny one, where each kernel's fixed cost
# dominates, and a mid-sized one, where its bytes do. What their time leaves after their GEMMs and attention
# (at the same section's measured rates) is what the element-wise part of a real block costs: module calls,
# autograd nodes, views, strided and GQA copies, gradient accumulation, which the kernel mix alone misses.
CALIBRATION_BLOCKS = ((2, 32, 64, 2, 1), (4, 64, 384, 6, 2))


# A decoder layer split over a tensor-parallel group, timed with every group of a section computing at once
# (its heads, KV heads and FFN width divide over 2 and 4 ranks), in alternating rounds with its compute twin
# (the same kernels, no collective), at two sizes: 2x64 and 4x128 tokens of width 384 (192 KB and 768 KB
# per fp32 activation). What it takes beyond the twin and beyond its collectives as timed back to back is
# what each collective of a run waits, a line in the activation's bytes through the two sizes (see
# ``plait.calibrate.tp_block``, ``plan.host.costs.HostCosts.tp_wait``).
TP_CALIBRATION_BLOCKS = ((2, 64, 384, 12, 4), (4, 128, 384, 12, 4))


# The pipelines ``plait calibrate`` times where processes outnumber the cores (``plait.calibrate.pipeline_block``):
# two stages of the larger calibration layer, 1F1B over this many micro-batches.
PIPELINE_CALIBRATION_MICROBATCHES = 4


def block_local(shape: tuple[int, ...], tp: int = 1, sp: bool = False) -> Local:
    """The sizes of calibration block ``shape`` (``CALIBRATION_BLOCKS``, ``TP_CALIBRATION_BLOCKS``) on one of
    ``tp`` ranks (``sp``: sequence parallel) as the census counts them."""
    b, s, h, heads, kv = shape
    return Local(float(b * s), float(s), h, h // heads, float(heads / tp), max(float(kv / tp), 1.0),
                 float(llama_ffn(h) / tp), 0.0, tp, sp and tp > 1)
