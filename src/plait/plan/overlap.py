"""What of the data-parallel communication at the end of a step the compute hides in Megatron-style runs: the
gradient reduction beside the last backwards of the step, the updated weights' gather beside the first forwards of
the next.

Megatron-Core's distributed optimizer (NVIDIA/Megatron-LM megatron/core at commit ee6737da) reduce-scatters a model
chunk's gradient buckets as its last micro-batch's backward fills them (``overlap_grad_reduce``; the pipeline
schedules enable the chunk's gradient sync at its last micro-batch, pipeline_parallel/schedules.py) and, with
``overlap_param_gather``, issues the all-gather of the updated weights asynchronously and has each module's forward
pre-hook wait for its bucket (distributed/distributed_data_parallel.py, ``_make_forward_pre_hook``;
param_and_grad_buffer.py, ``finish_param_sync``), chunk by chunk ahead of each chunk's first forward
(``align_param_gather``). The collectives of a rank run one after another on its network.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.plan.accumulation import traffic
from plait.plan.pipeline import SPLIT_BACKWARD

if TYPE_CHECKING:
    from plait.plan.config import Layout, Training
    from plait.plan.costs import CostModel


def exposed_tail(comm: float, window: float, chunks: int = 1, pp: int = 1, own: bool = True) -> float:
    """Seconds a DP collective of ``comm`` seconds adds to the step when it runs beside ``window`` seconds of one
    micro-batch's compute on a rank of ``chunks`` model chunks in a pipeline of ``pp`` stages.

    The collective runs chunk by chunk, comm/V each (V = ``chunks``), in the order the rank meets its chunks. The
    gradient reduction: an interleaved schedule's cool-down runs the last ``pp`` micro-batches' backwards chunk
    by chunk, from the rank's last chunk down to its first (Narayanan et al. 2021, §2.2), so chunk k from the end
    may start reducing (k·pp + 1)·window/V before the backward ends (its own last backward included). The
    weights' gather, mirrored: the warm-up runs ``pp`` forwards of each chunk before the next, so chunk k's
    gather must end by (k·pp + 1)·window/V after the step starts. One network serves them in turn, so the step
    waits max over k of (k + 1)·comm/V - (k·pp + 1)·window/V, and never less than 0. One chunk: comm beyond the
    window. Linear in k: the largest term is the first or the last chunk's. ``own`` False: a chunk's reduction
    cannot run beside its own last backward (``AccumulationTraffic.after_backward``), only beside the later
    chunks' work: (k + 1)·comm/V - k·pp·window/V; one chunk: all of it."""
    v = max(1, chunks)
    piece, slot = comm / v, window / v
    mine = 1 if own else 0
    return max(0.0, piece - mine * slot, v * piece - ((v - 1) * pp + mine) * slot)


def dp_exposed(costs: CostModel, layout: Layout, training: Training, reduction: float, gather: float,
               backward: float, forward: float) -> tuple[float, float]:
    """(gradient reduction, weights' gather): the seconds of each that the step waits for. The reduction runs
    beside ``backward`` (a rank's backward of one micro-batch, less what ZeRO-3's gathers take of it) when
    ``Training.overlap_grad_reduce``, the gather beside ``forward`` (a rank's forward of one micro-batch) when
    ``Training.overlap_param_gather``; each as much as the cluster's cost model lets the network run beside the
    compute (``CostModel.hidden_reduction``), never beside a chunk's own last backward where the gradients reach
    the buckets only after it (``AccumulationTraffic.after_backward``: plait's bf16 copies of fp32 parameters under
    a split backward).
    Otherwise all of it: the gather then follows the optimizer step."""
    v, pp = layout.virtual_stages, layout.pp
    if training.overlap_grad_reduce:
        late = (traffic(training.grad_accumulation, training.precision, layout.zero).after_backward
                and layout.schedule in SPLIT_BACKWARD)
        reduction = exposed_tail(reduction, costs.hidden_reduction(backward), v, pp, own=not late)
    if training.overlap_param_gather:
        gather = exposed_tail(gather, costs.hidden_reduction(forward), v, pp)
    return reduction, gather
