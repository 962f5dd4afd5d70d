"""GEMM efficiency by the GEMM's shape: cuBLAS's tile and wave quantization on the GPU's SMs.

A GPU computes a GEMM's [M, N] output in tiles, one thread block (CTA) per tile, each SM running one tile at a
time: the tiles run in waves of ``sms`` tiles. A tile that overhangs the matrix still costs a whole tile (tile
quantization), and a last wave with fewer tiles than SMs leaves the others idle (wave quantization). NVIDIA,
"Matrix Multiplication Background User's Guide" (DU-09799-001_v001, February 2023; docs.nvidia.com/deeplearning/
performance/dl-performance-matrix-multiplication), §2.3 "Typical Tile Dimensions in cuBLAS and Performance" (the
tiles cuBLAS chooses from, larger ones more efficient but fewer to run in parallel), §3.1 "Tile Quantization" and
§3.2 "Wave Quantization". A GEMM's share of its ceiling is then the useful work over what its waves occupy:
M·N / (waves · sms · tile_m · tile_n).

Which tile: the guide names the tiles cuBLAS has (§2.3, most to least efficient: 256x128 and 128x256, 128x128,
256x64 and 64x256, 128x64 and 64x128, 64x64) and says a heuristic picks the one expected to run fastest, trading
tile efficiency (larger tiles reuse more data) against tile parallelism (fewer of them to fill the GPU), the
largest tiles once a GEMM is large enough to fill the GPU with them. It prints no figure of the tiles' own
efficiencies, so none is assumed: the pick is the most efficient group whose tiles fill one wave
(``quantization``). Picking instead whichever tile wastes least, all tiles equally fast, would nearly always pick
64x64 and leave almost nothing quantized, which is not what cuBLAS does with large GEMMs. The H100 is costed with
the same tiles on its 132 SMs (Hopper's cuBLAS kernels are not modelled apart).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache

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
