"""GEMM cost by the GEMM's shape: its operands' and result's HBM traffic on every GPU, and cuBLAS's tile and wave
quantization on the GPUs whose cuBLAS the guide describes.

Traffic. A GEMM reads its two operands and writes its result through HBM; the narrower it is, the more bytes it
moves per FLOP. Its time is costed as its FLOPs at the GPU's GEMM ceiling plus those bytes (bf16, each matrix once)
at the datasheet's memory bandwidth: the roofline's two bounds (Williams, Waterman and Patterson, "Roofline: An
Insightful Visual Performance Model for Multicore Architectures", CACM 52(4), 2009), summed rather than the larger
taken, as a GEMM that streams its operands does not hide all of it under its math. On an H200, 731 shapes measured
(``plan.measured_gemm_h200``: every GEMM of the 90 published runs, and grids over the output width and the
reduction depth) run at speeds this correlates 0.73 with (the larger bound alone: 0.27); at m = n = 8,192 it
puts a reduction depth k of 512 and of 2,048 at 80% and 94% of the speed at k = 32,768, where 74% and 91% were
measured.

Quantization. A GPU computes a GEMM's [M, N] output in tiles, one thread block (CTA) per tile, each SM running one
tile at a time: the tiles run in waves of ``sms`` tiles. A tile that overhangs the matrix still costs a whole tile
(tile quantization), and a last wave with fewer tiles than SMs leaves the others idle (wave quantization). NVIDIA,
"Matrix Multiplication Background User's Guide" (DU-09799-001_v001, February 2023; docs.nvidia.com/deeplearning/
performance/dl-performance-matrix-multiplication), §2.3 "Typical Tile Dimensions in cuBLAS and Performance" (the
tiles cuBLAS chooses from, larger ones more efficient but fewer to run in parallel), §3.1 "Tile Quantization" and
§3.2 "Wave Quantization". A GEMM's share of its ceiling is then the useful work over what its waves occupy:
M·N / (waves · sms · tile_m · tile_n). The guide's measurements are of the cuBLAS 10-11 era (its Figure 2
compares cuBLAS 10.1 with 11.0); the catalogue applies it where ``GPU.tile_quantization`` is set (the A100s).
On the H200 (Hopper, the H100 SXM5's 132 SMs) the measured speeds show none of it: the shares correlate 0.06
with them over the 731 shapes and -0.24 over the grid across wave boundaries (shapes it puts at 55-61% ran at
82-100% of the fastest), so the Hopper GPUs are costed unquantized.

Which tile: the guide names the tiles cuBLAS has (§2.3, most to least efficient: 256x128 and 128x256, 128x128,
256x64 and 64x256, 128x64 and 64x128, 64x64) and says a heuristic picks the one expected to run fastest, trading
tile efficiency (larger tiles reuse more data) against tile parallelism (fewer of them to fill the GPU), the
largest tiles once a GEMM is large enough to fill the GPU with them. It prints no figure of the tiles' own
efficiencies, so none is assumed: the pick is the most efficient group whose tiles fill one wave
(``quantization``). Picking instead whichever tile wastes least, all tiles equally fast, would nearly always pick
64x64 and leave almost nothing quantized, which is not what cuBLAS does with large GEMMs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait.plan.catalogue import GPU

# cuBLAS's CTA tiles (Matrix Multiplication Background User's Guide, §2.3), most to least efficient, in groups of
# equal efficiency.
TILE_GROUPS: tuple[tuple[tuple[int, int], ...], ...] = (
    ((256, 128), (128, 256)), ((128, 128),), ((256, 64), (64, 256)), ((128, 64), (64, 128)), ((64, 64),))


def utilisation(m: float, n: float, sms: int, tile: tuple[int, int]) -> float:
    """The share of ``sms`` SMs' time over the waves of ``tile``-sized tiles of an [m, n] output that does useful
    work (§3.1 and §3.2): m·n / (waves · sms · tile area), waves = ceil(tiles / sms)."""
    tm, tn = tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    return m * n / (math.ceil(tiles / sms) * sms * tm * tn)


@lru_cache(maxsize=1 << 16)
def quantization(m: float, n: float, sms: int) -> float:
    """The share of its ceiling a GEMM with an [m, n] output reaches on ``sms`` SMs after tile and wave
    quantization, for the tile cuBLAS would pick: the most efficient group of tiles (§2.3's order) whose tiles
    fill at least one wave, the better-fitting orientation of that group; where no tile fills a wave, the tile
    that occupies the SMs best. 1.0 without an SM count."""
    if sms < 1 or m <= 0 or n <= 0:
        return 1.0
    for group in TILE_GROUPS:
        if any(math.ceil(m / tm) * math.ceil(n / tn) >= sms for tm, tn in group):
            return max(utilisation(m, n, sms, tile) for tile in group)
    return max(utilisation(m, n, sms, tile) for group in TILE_GROUPS for tile in group)


def passes(gemms: Iterable[tuple[float, float, float, float]], sms: int) -> tuple[float, float, float]:
    """(forward, data-gradient, weight-gradient) quantization of a set of GEMMs ``(m, n, k, count)`` (an [m, k]
    by [k, n] product, ``count`` of them), each the FLOP-weighted harmonic mean over the set, so that their FLOPs
    over it are their time at the ceiling. The data gradient multiplies [m, n] by [n, k] (an [m, k] output), the
    weight gradient [k, m] by [m, n] (a [k, n] output): the same FLOPs on other output shapes."""
    work = [0.0, 0.0, 0.0, 0.0]
    for m, n, k, count in gemms:
        flops = m * n * k * count
        work[0] += flops
        work[1] += flops / quantization(m, n, sms)
        work[2] += flops / quantization(m, k, sms)
        work[3] += flops / quantization(k, n, sms)
    if work[0] <= 0:
        return 1.0, 1.0, 1.0
    return work[0] / work[1], work[0] / work[2], work[0] / work[3]


def operand_bytes(gemms: Iterable[tuple[float, float, float, float]]) -> float:
    """HBM bytes of a set of GEMMs ``(m, n, k, count)`` in bf16: each reads its [m, k] and [k, n] operands and
    writes its [m, n] result once, 2 bytes an element. The data gradient ([m, n] by [n, k]) and the weight gradient
    ([k, m] by [m, n]) read and write the same three shapes, so each pass moves these bytes."""
    return sum(2 * (m * k + k * n + m * n) * count for m, n, k, count in gemms)


def gemm_speed(gpu: GPU) -> float:
    """FLOP/s of a large GEMM on ``gpu``: its peak at its fitted ceiling (``GPU.matmul_efficiency``)."""
    return gpu.peak_flops * gpu.matmul_efficiency


def gemm_seconds(gpu: GPU, m: float, n: float, k: float) -> float:
    """Seconds the planner costs one [m, k] x [k, n] GEMM on ``gpu``: its FLOPs at ``gemm_speed``, after tile and
    wave quantization where the GPU's cuBLAS has it (``GPU.tile_quantization``), plus its operands and result
    (``operand_bytes``) at the memory bandwidth. ``plan.gpu`` costs a layer's GEMMs this way, pass by pass."""
    share = quantization(m, n, gpu.sms) if gpu.tile_quantization else 1.0
    return 2 * m * n * k / (gemm_speed(gpu) * share) + operand_bytes([(m, n, k, 1.0)]) / gpu.memory_bandwidth


def scaled_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean |relative error| of ``predicted`` against ``measured`` speeds after one common scale (the median
    ratio): how well a model follows the measurements' shape, whatever its level (its ceiling is fitted apart)."""
    scale = statistics.median(m / p for p, m in zip(predicted, measured, strict=True))
    return statistics.fmean(abs(m / (p * scale) - 1) for p, m in zip(predicted, measured, strict=True))
