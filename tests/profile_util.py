"""A synthetic host profile (plait.plan.host.profile) for tests that need one but do not test its figures."""

from __future__ import annotations

from plait.plan.host import shapes
from plait.plan.host.figures import COLLECTIVES, LAYER, SELECTIVE, Curve, Rate, TPBlock
from plait.plan.host.profile import HostProfile, Section


def synthetic_section(p: int, cores: int = 2, block: bool = False, layers: bool = False) -> Section:
    """Speeds shaped like a small CPU host: 50 GFLOP/s per core shared among ``p`` processes; ``block``: with
    the decoder-layer timings, the optimizer step and the tensor-parallel layers of a format-3 profile;
    ``layers`` (with ``block``): also the whole layers' seconds and what recomputing their attention cores adds,
    as in a profile of this version, which ``plait train`` measures nothing beside (plait.cli.predict)."""
    share = min(1.0, cores / p)
    rates = {
        "matmul": Rate((1e6, 1e9), (2e10, 5e10), (2e10 * share, 5e10 * share)),
        "attention": Rate((2048.0, 32768.0), (1e10, 2e10), (1e10 * share, 2e10 * share), 0.3),
        "elementwise": Rate((1e4, 4e6), (4e9, 6e9), (4e9 * share, 6e9 * share), 0.35),
    }
    curves = {(op, g): Curve((1024.0, 4e6), (5e-5 * g, 5e-5 * g + 4e6 / 2e9))
              for g in range(2, p + 1) if p % g == 0 for op in COLLECTIVES if op != "p2p" or g == 2}
    if block:  # seconds beyond GEMMs and attention of plan.shapes.CALIBRATION_BLOCKS
        rates["block"] = Rate((4096.0, 98304.0), (1.5e-3, 6e-3), (1.5e-3 / share, 6e-3 / share), 0.3)
    if block and layers:
        rates[LAYER] = Rate((4096.0, 98304.0), (4e-3, 2e-2), (4e-3 / share, 2e-2 / share), 0.4)
        rates[SELECTIVE] = Rate((4096.0, 98304.0), (4e-4, 2e-3), (4e-4 / share, 2e-3 / share), 0.4)
    # a TP layer as plait.calibrate.tp_block times it, over every group size the section measures
    tp = tuple(TPBlock(shape, g, sp, 0.02 * g * i / share, 0.015 * g * i / share)
               for i, shape in enumerate(shapes.TP_CALIBRATION_BLOCKS, 1)
               for g in range(2, p + 1) if p % g == 0 for sp in (False, True)) if block else ()
    piped = block and p % 2 == 0 and p > cores  # a pipeline timed where processes outnumber the cores
    return Section(p, max(1, cores // p), rates, 1e-5, 5e9, curves, 4e-9 if block else 0.0, tp, 3e-5 if block else 0.0,
                   0.25 if piped else 0.0, 0.23 if piped else 0.0)


def synthetic_profile(facts: dict | None = None, counts=(1, 2, 4, 8), block: bool = False,
                      layers: bool = False) -> HostProfile:
    facts = facts or {"hostname": "testhost", "cpu": "test cpu", "cores": 2, "memory_bytes": 24 * 2**30,
                      "torch": "2.13.0", "backend": "gloo", "device": "cpu"}
    return HostProfile(dict(facts), {p: synthetic_section(p, int(facts["cores"]), block, layers) for p in counts})
