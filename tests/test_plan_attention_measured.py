"""The attention kernel the planner costs plait's own run with, and its published figures, against the causal
SDPA speeds measured on an H200 (``plan.measured_attention_h200``)."""

import statistics

import pytest

from plait.plan.attention import efficiency, sdpa_kernel
from plait.plan.catalogue import get_gpu
from plait.plan.measured_attention_h200 import RUN_A, RUN_B, Measured

H200 = get_gpu("h200")
SHAPES = list(zip(RUN_A, RUN_B, strict=True))
GRID = [(a, b) for a, b in SHAPES if a.case != "plait"]
FWD_BWD = 1


def speed(a: Measured, b: Measured, backend: str) -> float:
    """A shape's forward + backward TFLOP/s: the mean of its two passes in each of the two runs."""
    return statistics.fmean(a.tflops[backend][FWD_BWD] + b.tflops[backend][FWD_BWD])  # type: ignore[index]


def planned(kernel: str, m: Measured) -> float:
    """The TFLOP/s the planner charges ``kernel`` at for this shape on the H200 (forward and backward alike)."""
    return efficiency(H200, kernel, m.seq, m.head_dim) * H200.peak_flops / 1e12


def test_the_measurement_is_what_its_docstring_says():
    assert len(RUN_A) == len(RUN_B) == 37 and all((a.case, a.seq, a.heads) == (b.case, b.seq, b.heads)
                                                  for a, b in SHAPES)
    assert {a.seq for a, _ in GRID} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {a.head_dim for a, _ in GRID} == {64, 128}
    assert all(a.batch * a.seq == 16384 for a, _ in GRID)
    plait = RUN_A[-1]
    shape = (plait.case, plait.batch, plait.seq, plait.heads, plait.kv_heads, plait.head_dim)
    assert shape == ("plait", 4, 2048, 12, 4, 128)
    assert plait.tflops["efficient"] is None  # grouped KV heads: the memory-efficient backend refuses them
    passes = [abs(x - y) / max(x, y) for m in RUN_A + RUN_B for t in m.tflops.values() if t for x, y in t]
    assert statistics.median(passes) == pytest.approx(0.006, abs=0.001)


def test_sdpa_ran_cudnn_on_every_shape_the_kernel_the_own_run_is_costed_with():
    """torch's SDPA picked cuDNN's kernel unforced on every shape of both runs, plait's own included, the fastest
    backend on each: ``sdpa_kernel`` names it for the H200."""
    assert {m.picked for m in RUN_A + RUN_B} == {"cudnn"} == {sdpa_kernel(H200)}
    ratios = [speed(a, b, "cudnn") / speed(a, b, "flash") for a, b in GRID]
    assert 1.4 < min(ratios) and max(ratios) < 2.0
    assert all(speed(a, b, "efficient") < speed(a, b, "flash") for a, b in GRID)


def test_the_published_figures_against_the_h200():
    """FlashAttention-2's H100 figures put torch's flash backend at 0.82-1.00 of its measured speed (median
    0.93); cuDNN's, from an older cuDNN, at 0.87-1.19 (median 1.06), under it at head dimension 128 from 2k
    tokens on; plait's own attention at 0.93 of cuDNN's figure, 1.38 of FlashAttention-2's."""
    flash = [speed(a, b, "flash") / planned("flash2", a) for a, b in GRID]
    assert 0.8 < min(flash) and max(flash) < 1.01 and statistics.median(flash) == pytest.approx(0.93, abs=0.01)
    cudnn = [speed(a, b, "cudnn") / planned("cudnn", a) for a, b in GRID]
    assert 0.85 < min(cudnn) and max(cudnn) < 1.2 and statistics.median(cudnn) == pytest.approx(1.06, abs=0.01)
    assert all(speed(a, b, "cudnn") > planned("cudnn", a) for a, b in GRID if a.head_dim == 128 and a.seq >= 2048)
    a, b = SHAPES[-1]
    assert speed(a, b, "cudnn") / planned("cudnn", a) == pytest.approx(0.93, abs=0.01)
    assert speed(a, b, "cudnn") / planned("flash2", a) == pytest.approx(1.38, abs=0.01)
