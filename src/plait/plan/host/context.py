"""A context-parallel rank's attention core and K/V exchange on a calibrated host, as plait runs them.

plait.context_parallel does not call SDPA: each rank attends with plait.context_parallel.blockwise, one score
tile of up to ``TILE`` query rows against one key segment (a CP chunk of ``c = s/2`` keys, ``s`` the rank's
tokens) at a time, tiles that see no key skipped, partial results merged by their log-sum-exp. So the core is
costed tile by tile: its batched GEMMs at the profile's matmul rate and its passes over each ``[B, h, rows, c]``
score tile (and over the output per segment) at the element-wise rate, each kernel with its fixed cost. The
keys and values reach the rank by the ring's point-to-point transfers (``Ring.start``) or by all-gathers
(``gather_kv``), costed with the profile's p2p and collective curves.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from plait.parallel_config import CP_TILE as TILE
from plait.parallel_config import cp_chunks
from plait.plan.host import census
from plait.plan.host.profile import Section

# Element traffic (reads + writes, in elements of a score tile) and kernels of blockwise._forward_block per
# tile: _scores' q kᵀ·scale (mul_), amax, sub_, exp_, sum; a partly visible tile adds masked_fill_ (and its mask)
SCORE_FWD_TRAFFIC, SCORE_FWD_OPS = 8, 5
# attend_backward per tile: _scores' mul_, sub_(lse), exp_, ds's sub_(delta) and mul_(p)
SCORE_BWD_TRAFFIC, SCORE_BWD_OPS = 9, 5
MASK_TRAFFIC, MASK_OPS = 3, 1  # masked_fill_ (read, write) and the mask's read
FWD_GEMMS, BWD_GEMMS = 2, 5  # q kᵀ, p v; backward: q kᵀ again, pᵀ dout, dout vᵀ, ds k, dsᵀ q
# per tile, over its rows' output (forward: the division by the sum and the copy into out) or, backward, its
# rows' dq (·scale, +=) and the segment's dk, dv (·scale, +=; +=)
TILE_OUT_FWD_TRAFFIC, TILE_OUT_FWD_OPS = 5, 2
TILE_Q_BWD_TRAFFIC, TILE_K_BWD_TRAFFIC, TILE_BWD_OPS = 5, 8, 5
# per segment: _forward_block's zeros and -inf buffers, and merge (logaddexp, where, two exps, two products and
# their sum over the output)
SEGMENT_TRAFFIC, SEGMENT_OPS = 8, 9


@dataclass(frozen=True)
class Tile:
    """One score tile blockwise computes: ``rows`` queries against ``keys`` keys, ``masked`` if some are hidden."""

    rows: int
    keys: int
    masked: bool


@lru_cache(maxsize=256)
def tiles(s: int, cp: int, rank: int, window: int | None) -> tuple[tuple[Tile, ...], int]:
    """The score tiles CP rank ``rank`` (``s`` tokens) computes in one forward over the whole row's keys, and the
    segments it attends to (blockwise.attend's loop over a chunk of keys at a time, its inner loop over TILE query
    rows; ``causal_mask``'s rule: key k seen by query q iff k <= q and, with a window W, k > q - W)."""
    c = s // 2
    out: list[Tile] = []
    segments = 0
    mine = [q for chunk in cp_chunks(s, cp, rank) for q in chunk]  # global position of each local query
    for key_rank in range(cp):
        for chunk in cp_chunks(s, cp, key_rank):
            ka, kb = chunk.start, chunk.stop - 1
            segments += 1
            for a in range(0, s, TILE):
                qs = mine[a:a + TILE]
                seen = [max(0, min(q, kb) - max(ka, q - window + 1 if window else ka) + 1) for q in qs]
                if any(seen):
                    out.append(Tile(len(qs), c, sum(seen) < len(qs) * c))
    return tuple(out), segments


def _elementwise(sec: Section, shared: bool, traffic: float, ops: float) -> float:
    """Seconds of forward-style element-wise kernels moving ``traffic`` bytes: the mix's speed at their bytes per
    kernel, its forward share (as the calibration's rate counts forward and backward per forward byte)."""
    if ops <= 0:
        return 0.0
    elem = sec.rates["elementwise"]
    return (traffic / elem.at(traffic / ops, shared) + ops * sec.op_overhead_s) * elem.forward_share


def attention(sh: census.Local, sec: Section, shared: bool, window: int | None) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's CP attention core on the slowest rank (``tiles``), fp32 as
    blockwise computes whatever the precision."""
    s, cp, d = int(sh.seq), sh.cp, sh.head_dim
    batch_heads = sh.tokens / sh.seq * sh.heads
    mm = sec.rates["matmul"]
    worst = (0.0, 0.0)
    for rank in range(cp):
        found, segments = tiles(s, cp, rank, window)
        f = b = 0.0
        for t in found:
            flops = 2 * batch_heads * t.rows * t.keys * d
            gemm = flops / mm.at(flops, shared)
            e = batch_heads * t.rows * t.keys * 4
            mask_t, mask_o = (MASK_TRAFFIC * e, MASK_OPS) if t.masked else (0.0, 0)
            q_tile, k_seg = batch_heads * t.rows * d * 4, batch_heads * t.keys * d * 4
            f += FWD_GEMMS * gemm + _elementwise(sec, shared, SCORE_FWD_TRAFFIC * e + mask_t
                                                 + TILE_OUT_FWD_TRAFFIC * q_tile, SCORE_FWD_OPS + mask_o
                                                 + TILE_OUT_FWD_OPS)
            b += BWD_GEMMS * gemm + _elementwise(sec, shared, SCORE_BWD_TRAFFIC * e + mask_t
                                                 + TILE_Q_BWD_TRAFFIC * q_tile + TILE_K_BWD_TRAFFIC * k_seg,
                                                 SCORE_BWD_OPS + mask_o + TILE_BWD_OPS)
        f += segments * _elementwise(sec, shared, SEGMENT_TRAFFIC * sh.q * 4, SEGMENT_OPS)
        if f + b > sum(worst):
            worst = (f, b)
    return worst


def exchange(sh: census.Local, sec: Section, dtype_bytes: int) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's K/V exchange. Ring (plait.context_parallel.attention's
    _RingAttention): cp-1 transfers of the rank's keys and values in one message, forward and again backward, and
    backward cp transfers of their float32 gradients; each as the profile's p2p of that message. All-gather
    (GatheredCore): keys and values each all-gathered forward, their gradients reduce-scattered backward."""
    cp = sh.cp
    kv = 2 * sh.k * dtype_bytes
    if sh.cp_gather:
        whole = cp * sh.k * dtype_bytes
        return (2 * sec.collective("all_gather", cp, whole), 2 * sec.collective("reduce_scatter", cp, whole))
    p2p = sec.collective("p2p", 2, kv)
    grads = sec.collective("p2p", 2, 2 * sh.k * 4)
    return (cp - 1) * p2p, (cp - 1) * p2p + cp * grads
