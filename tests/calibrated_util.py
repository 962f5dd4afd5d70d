"""Hand-computable host profiles for the calibrated-host model tests (flat kernel rates, synthetic sections)."""

from plait.plan import Cluster
from plait.plan.host import census, shapes
from plait.plan.host import compute as host_compute
from plait.plan.host.figures import Rate
from plait.plan.host.profile import HostProfile, Section
from plait.plan.host.shapes import block_local

MATMUL, ATTENTION, MIX, OVERHEAD = 4e10, 1e10, 5e9, 1e-5  # flat rates: every term computable by hand


def host_section(block_rest: tuple[float, float] | None, optimizer: float = 0.0, per_tensor: float = 0.0) -> Section:
    rates = {"matmul": Rate((1.0, 1e12), (MATMUL, MATMUL), (MATMUL / 2, MATMUL / 2)),
             "attention": Rate((1.0, 1e12), (ATTENTION,) * 2, (ATTENTION / 2,) * 2, 0.25),
             "elementwise": Rate((1.0, 1e12), (MIX,) * 2, (MIX / 2,) * 2, 0.4)}
    if block_rest is not None:
        sizes = tuple(float(b * s * h) for b, s, h, *_ in shapes.CALIBRATION_BLOCKS)
        rates["block"] = Rate(sizes, block_rest, tuple(2 * r for r in block_rest), 0.3)
    return Section(1, 2, rates, OVERHEAD, 1e10, {}, optimizer, (), per_tensor)


def host_blocks(model, cluster, layout, precision="bf16", shared=False):
    """(layer, embedding, head) per micro-batch from the cluster's host cost model (``shared``: its shared twin)."""
    costs = cluster.costs.shared_twin() if shared else cluster.costs
    b = costs.blocks(model, layout, precision)
    return b.layer, b.embedding, b.head


def host_cluster(section: Section) -> Cluster:
    return Cluster.from_profile(HostProfile({"hostname": "h", "cores": 2}, {1: section}), 1)


def with_layers(sec: Section, alone: tuple[float, float], shared: tuple[float, float]) -> Section:
    """``sec`` with whole calibration layers measured at ``alone`` / ``shared`` times what its kernel figures
    give the same layers."""
    from dataclasses import replace

    from plait.plan.host.figures import LAYER

    model = {x: [host_compute.work_costs(census.layer_work(shapes.block_local(b), 4), sec, x, layer=True)
                 for b in shapes.CALIBRATION_BLOCKS] for x in (False, True)}
    seconds = {x: [c.f_compute + c.b_compute for c in model[x]] for x in (False, True)}
    sizes = tuple(float(b * s * h) for b, s, h, *_ in shapes.CALIBRATION_BLOCKS)
    layer = Rate(sizes, tuple(f * t for f, t in zip(alone, seconds[False], strict=True)),
                 tuple(f * t for f, t in zip(shared, seconds[True], strict=True)), 0.36)
    return replace(sec, rates={**sec.rates, LAYER: layer})


def tp_cluster(waits: dict[tuple[int, bool], float | tuple[float, ...]], p: int = 4,
                shapes: tuple = shapes.TP_CALIBRATION_BLOCKS) -> Cluster:
    """A section whose TP layers (plait.calibrate.tp_block) took their twin's time, their collectives as the
    curves time them back to back, and ``waits[(group, sp)]`` more per collective (one figure for every
    shape of ``shapes``, or one per shape)."""
    from plait.plan.host.figures import COLLECTIVES, Curve, TPBlock

    base = host_section(None)
    curves = {(op, g): Curve((1024.0, 4e6), (1e-4 * g, 1e-4 * g + 4e6 / 1e9))
              for g in (2, 4) for op in COLLECTIVES if op != "p2p" or g == 2}
    sec = Section(p, 1, base.rates, OVERHEAD, 1e10, curves)
    blocks = []
    for (g, sp), w in waits.items():
        per_shape = w if isinstance(w, tuple) else (w,) * len(shapes)
        for shape, wait in zip(shapes, per_shape, strict=True):
            sh = block_local(shape, g, sp)
            # SP: the regions' gathers, again in the backward, and the row-parallel layers' scatters, each conjugate
            ops = (("all_gather", 6), ("reduce_scatter", 4)) if sp else (("all_reduce", 4),)
            back_to_back = sum(n * sec.collective(op, g, sh.n * 4) for op, n in ops)
            blocks.append(TPBlock(shape, g, sp, 0.03 + back_to_back + wait * (10 if sp else 4), 0.03))
    sec = Section(p, 1, base.rates, OVERHEAD, 1e10, curves, 0.0, tuple(blocks))
    return Cluster.from_profile(HostProfile({"hostname": "h", "cores": 2}, {p: sec}), p)
