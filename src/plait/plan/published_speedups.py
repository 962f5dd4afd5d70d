"""Published speed-ups between two setups of one run, which check a cost the time model charges (recomputation).

A speed-up needs no absolute step time: the ratio of the two printed utilisations is the ratio of the two step
times (same model, same batch, same GPUs). As in ``plan.published``: only figures read in a public text.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.cluster import Cluster
from plait.plan.config import Layout, Training
from plait.plan.estimate import estimate
from plait.plan.model import Model
from plait.plan.published import gpt


@dataclass(frozen=True)
class Speedup:
    """``slow`` and ``fast`` setups of one run and the printed ratio of their step times (slow / fast)."""

    source: str
    where: str
    label: str
    model: Model
    cluster: Cluster
    slow: Layout
    fast: Layout
    training: Training
    printed: str  # as printed
    published: float  # step(slow) / step(fast) the printed figures imply
    assumed: tuple[str, ...] = ()

    def planner(self) -> float:
        """The planner's step(slow) / step(fast)."""
        def step(layout: Layout) -> float:
            return estimate(self.model, self.cluster, layout, self.training).step_time_s

        return step(self.slow) / step(self.fast)


# Korthikanti et al. 2022 (arXiv 2205.05198), abstract: "when training a 530B parameter GPT-3 style model on 2240
# NVIDIA A100 GPUs, we achieve a Model Flops Utilization of 54.2%, which is 29% faster than the 42.1% we achieve
# using recomputation": full recomputation against sequence parallelism with selective recomputation. The abstract
# prints neither the layout nor the batch: MT-NLG's 8-way tensor and 35-way pipeline parallelism (Smith et al.
# 2022) and a batch of one sequence per GPU are assumed; the planner's ratio barely moves with the batch.
KORTHIKANTI_ABSTRACT = ("Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models "
                        "(arXiv 2205.05198), abstract")


def speedups() -> list[Speedup]:
    """Every published speed-up the time model is checked against."""
    m = gpt(105, 20480, 128, name="mt-nlg-530b")
    full = Layout(tp=8, pp=35, dp=8, recompute="full")
    return [Speedup("Korthikanti et al. 2022", KORTHIKANTI_ABSTRACT, "530B on 2240 A100: full recomputation -> "
                    "sequence parallelism + selective recomputation", m,
                    Cluster("a100-80gb", 2240, interconnect="ib-hdr", flash_attention=False), full,
                    Layout(tp=8, pp=35, dp=8, recompute="selective", sequence_parallel=True), Training(2240),
                    "Model Flops Utilization of 54.2% ... the 42.1% we achieve using recomputation", 54.2 / 42.1,
                    ("t8 p35 (MT-NLG's layout)", "global batch 2240, micro-batch 1", "1F1B, not interleaved",
                     "Selene: HDR InfiniBand"))]


def format_speedups(rows: list[Speedup] | None = None) -> str:
    """One line per published speed-up: printed, the planner's, and the difference."""
    lines = []
    for s in rows if rows is not None else speedups():
        p = s.planner()
        lines.append(f"{s.label}: published x{s.published:.3f} ({s.printed}); planner x{p:.3f} "
                     f"({100 * (p / s.published - 1):+.1f}%) ({s.where})")
    return "\n".join(lines)
