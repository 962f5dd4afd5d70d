"""The compute seconds of plait's eager work on a calibrated host (``Cluster.from_profile``).

Kernel figures (``plait calibrate``'s tight loops: GEMMs, attention, the element-wise mix) give each eager
block's forward and backward (``work_costs``); the calibration's real decoder layers set their level
(``in_step``: kernels run slower in a step, on working sets the others evicted, and processes share the
cores as real layers do), a tensor-parallel layer's its compute twin's (``in_tp_step``), a layer's split
between forward and backward (``forward_share_factor``) and what selective recomputation adds
(``selective_recompute``). ``plan.host.costs`` adds the collectives; ``plan.timing`` assembles the chunks.
"""

from __future__ import annotations

import math

from plait.plan.costs import StageCosts
from plait.plan.host import census
from plait.plan.host.figures import BLOCK, LAYER, SELECTIVE, Rate
from plait.plan.host.profile import Section
from plait.plan.host.shapes import CALIBRATION_BLOCKS, block_local

# A calibration block's time beyond its GEMMs and attention is floored at this share of what the kernel mix
# says its element-wise part costs (timing noise must not make it free).
BLOCK_REST_FLOOR = 0.1


def _gemm_attention(work: census.Work, sec: Section, shared: bool) -> tuple[float, float]:
    """(forward GEMM seconds, forward + backward attention seconds) of ``work`` at the measured rates."""
    mm, attn = sec.rates["matmul"], sec.rates["attention"]
    gemm = sum(flops / mm.at(size, shared) for flops, size in work.gemms)
    return gemm, work.attention / attn.at(work.attention_size, shared) if work.attention else 0.0


def block_elementwise(sec: Section) -> Rate | None:
    """The element-wise speed of a real decoder layer on this host, or None if the profile did not time the
    calibration blocks (``plan.CALIBRATION_BLOCKS``): per block, the bytes the census counts over the
    seconds its forward + backward took beyond its GEMMs and attention (as ``plait calibrate`` measured them,
    floored at ``BLOCK_REST_FLOOR`` of the element-wise mix's estimate); keyed, as the mix, by bytes per
    kernel. It stands for the mix and the per-kernel cost."""
    blk = sec.rates.get(BLOCK)
    shapes = CALIBRATION_BLOCKS
    if blk is None or tuple(blk.sizes) != tuple(float(b * s * h) for b, s, h, *_ in shapes):
        return None
    works = [census.layer_work(block_local(shape), 4) for shape in shapes]  # fp32, as calibrated
    mix = sec.rates["elementwise"]
    speeds: dict[bool, list[float]] = {}
    # shared: the rest alone times the element-wise kernels' slow-down (``Rate.slowdown``). The rest is
    # element-wise work, and its own shared figure is a small difference of two noisy ones, too unsteady to use
    for shared, secs in ((False, blk.alone), (True, tuple(a * mix.slowdown for a in blk.alone))):
        speeds[shared] = []
        for w, rest in zip(works, secs, strict=True):
            per_op = w.elem_bytes / w.ops
            floor = BLOCK_REST_FLOOR * (w.elem_bytes / mix.at(per_op, shared) + w.ops * sec.op_overhead_s)
            speeds[shared].append(w.elem_bytes / max(rest, floor))
    return Rate(tuple(w.elem_bytes / w.ops for w in works), tuple(speeds[False]), tuple(speeds[True]),
                blk.forward_share)


def work_costs(work: census.Work, sec: Section, shared: bool, layer: bool = False) -> StageCosts:
    """Seconds of an eager block's forward and backward from the host's measured speeds; a ``layer``'s
    element-wise part at a real decoder layer's speed where the profile timed one (``block_elementwise``)."""
    attn, elem = sec.rates["attention"], sec.rates["elementwise"]
    gemm, att = _gemm_attention(work, sec, shared)
    per_op = work.elem_bytes / work.ops if work.ops else 0.0
    block = block_elementwise(sec) if layer else None
    if block is not None:  # split as the real layer's rest splits (``Section``: the block's forward share)
        el = work.elem_bytes / block.at(per_op, shared) if work.elem_bytes else 0.0
        share = block.forward_share
    else:
        el = (work.elem_bytes / elem.at(per_op, shared) if work.elem_bytes else 0.0) + work.ops * sec.op_overhead_s
        share = elem.forward_share
    nograd = work.nograd_ops * sec.op_overhead_s * elem.forward_share
    f = gemm + att * attn.forward_share + el * share + nograd
    b = 2 * gemm + att * (1 - attn.forward_share) + el * (1 - share)
    return StageCosts(f, b, gemm)


def whole_layers(sec: Section) -> Rate | None:
    """The calibration layers' whole seconds (``LAYER``), if the profile timed this version's layers."""
    whole = sec.rates.get(LAYER)
    sizes = tuple(float(b * s * h) for b, s, h, *_ in CALIBRATION_BLOCKS)
    return whole if whole is not None and tuple(whole.sizes) == sizes else None


def in_step(sec: Section, shared: bool, seconds: float) -> float:
    """How many times what the kernel figures give (``work_costs``) eager work takes inside a training step,
    where its kernels run one after another on working sets the others evicted, not each in a loop of its
    own; and, with ``shared``, with every process of the section at once, as a real layer shares the cores
    rather than as the kernels timed in pairs do (on a 2-core host two processes ran real layers at 0.99-1.0
    of their speed alone, where the kernels' pairs read 1.1-1.6). At each calibration block (``LAYER``) the
    real decoder layer's measured seconds over the kernel figures' for the same layer; between the blocks
    interpolated in the log of ``seconds`` (what the kernel figures give the work alone), flat beyond. 1 where
    the profile did not time whole layers (format < 4)."""
    whole = whole_layers(sec)
    if whole is None:
        return 1.0
    points = []
    for i, shape in enumerate(CALIBRATION_BLOCKS):
        work = census.layer_work(block_local(shape), 4)  # fp32, as calibrated
        alone, model = (work_costs(work, sec, x, layer=True) for x in (False, shared))
        measured = whole.shared[i] if shared else whole.alone[i]
        points.append((alone.f_compute + alone.b_compute, measured / (model.f_compute + model.b_compute)))
    return _log_line(points, seconds)


def forward_share_factor(sec: Section) -> float:
    """The larger calibration layer's measured forward share (of its whole forward + backward, ``LAYER``)
    over the share the kernel figures give the same layer: how much of a layer's compute the figures put in
    the forward that the layer spends in its backward (0.36 measured against 0.39-0.41 on a 2-core host: a
    pipeline's backwards and a recomputation's forward feel it, a step's total does not). 1 without whole
    layers (format < 4)."""
    whole = whole_layers(sec)
    if whole is None:
        return 1.0
    c = work_costs(census.layer_work(block_local(CALIBRATION_BLOCKS[-1]), 4), sec, False, layer=True)
    share = c.f_compute / (c.f_compute + c.b_compute)
    return whole.forward_share / share if share > 0 else 1.0


def in_tp_step(sec: Section, tp: int, seconds: float) -> float | None:
    """``in_step``'s shared factor for a layer sharded over ``tp`` ranks, from the tensor-parallel calibration
    layers' compute twins (``TPBlock.twin_s``: an unsharded layer of one rank's heads, KV heads and FFN
    width, timed with every group of the section at once) over what the kernel figures give the same layer,
    interpolated as ``in_step`` is between the twins of this group size (with and without sequence
    parallelism, which time the same twin); None where the profile timed no twin of ``tp`` ranks. The twins
    are the layers nearest a tensor-parallel run's in shape, and the waits of ``tp_wait`` are what the TP
    layer took beyond its twin: costing the compute as the twin makes the two add up to the layer timed."""
    points = []
    for blk in sec.tp_blocks:
        if blk.group != tp or blk.twin_s <= 0:
            continue
        work = census.layer_work(block_local(blk.shape, tp, False), 4)  # the twin: no SP, fp32
        alone, model = (work_costs(work, sec, x, layer=True) for x in (False, True))
        points.append((alone.f_compute + alone.b_compute, blk.twin_s / (model.f_compute + model.b_compute)))
    return _log_line(sorted(points), seconds) if points else None


def _log_line(points: list[tuple[float, float]], x: float) -> float:
    """The mean of each x's y, interpolated in log(x) between the smallest and largest x, flat beyond."""
    by_x: dict[float, list[float]] = {}
    for px, py in points:
        by_x.setdefault(px, []).append(py)
    xs = sorted(by_x)
    (x0, y0), (x1, y1) = (xs[0], sum(by_x[xs[0]]) / len(by_x[xs[0]])), (xs[-1], sum(by_x[xs[-1]]) / len(by_x[xs[-1]]))
    if x <= x0 or x1 <= x0:
        return y0
    if x >= x1:
        return y1
    return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)


def selective_recompute(sec: Section, shared: bool, sh: census.Local) -> float | None:
    """Seconds recomputing its attention core adds to a layer of sizes ``sh`` (plait's
    ``recompute="selective"``: the core under a non-reentrant checkpoint), on a calibrated host that timed
    its calibration layers with and without it (``SELECTIVE``; else None): the line through the blocks'
    measured additions (``shared``: with every process at it) against their query elements (``Local.q``,
    ``T·heads·d`` on a rank), at this layer's; not below 0. The addition is more than the core's forward:
    the checkpoint saves and unpacks its inputs through hooks and runs
    the forward with autograd recording, on working sets the layer evicted (a layer of 2 sequences of 128,
    4 heads over 2 KV heads of 32, one thread: 1.35 ms more than without it, the core alone in a loop 0.78
    ms, its forward 0.46 ms). A fixed part and a part growing with the tensors the checkpoint handles are what
    a line in the query elements holds; in the attention's FLOPs it put a layer of 4 sequences of 128 at 5.9
    ms where it took 3.7 (elements: 3.3)."""
    whole, redone = whole_layers(sec), sec.rates.get(SELECTIVE)
    if whole is None or redone is None or redone.sizes != whole.sizes:
        return None
    points = sorted((block_local(shape).q, redone.shared[i] if shared else redone.alone[i])
                    for i, shape in enumerate(CALIBRATION_BLOCKS))
    (x0, y0), (x1, y1) = points[0], points[-1]
    y = y0 if x1 <= x0 else y0 + (y1 - y0) * (sh.q - x0) / (x1 - x0)
    return max(0.0, y)


def in_step_costs(work: census.Work, sec: Section, shared: bool, layer: bool, tp: int = 1) -> StageCosts:
    """``work_costs`` times ``in_step``'s factor for work of that size; a ``layer`` over ``tp`` > 1 ranks
    also times what its compute twins say beyond that (``in_tp_step`` over ``in_step``'s shared factor: the
    twins set the level of a sharded layer, the whole layers how it shares the cores). A ``layer``'s forward
    and backward split as the calibration layer's measured split corrects the kernel figures'
    (``forward_share_factor``; the weight gradients' GEMMs stay as they are)."""
    alone = work_costs(work, sec, False, layer)
    c = alone if not shared else work_costs(work, sec, True, layer)
    seconds = alone.f_compute + alone.b_compute
    x = in_step(sec, shared, seconds)
    twin = in_tp_step(sec, tp, seconds) if layer and tp > 1 and whole_layers(sec) else None
    if twin is not None:
        x *= twin / in_step(sec, True, seconds)
    f, b = c.f_compute * x, c.b_compute * x
    if layer:
        moved = f - min(f * forward_share_factor(sec), f + b - c.w_compute * x)
        f, b = f - moved, b + moved
    return StageCosts(f, b, c.w_compute * x)
