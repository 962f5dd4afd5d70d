"""Layer counts per pipeline chunk: the one partition function of the runtime and the planner (no torch).

``pipeline.partition`` cuts a real model with it; ``plan`` costs the same cut. Costs are per token and
relative (multiply-accumulates): a decoder layer costs its matmul weights plus attention's QKᵀ and AV,
``2·s·h`` (Narayanan et al. 2021, eq. 2), the output head ``V·h`` plus the softmax, the embedding lookup
``h``. ``balanced`` minimises the most expensive chunk; among the cuts that reach that minimum it puts
the surplus layers on the *first* chunks' side as few as possible: later chunks are filled first, so the
first chunk — which also holds the embedding and, under 1F1B-like schedules, the most micro-batches in
flight — gets the fewest layers (as Llama 3 405B did: Dubey et al. 2024, §3.3.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from plait.errors import ConfigError

PARTITIONS = ("balanced", "uniform")
_TOL = 1e-12


def layer_macs(matmul_params: float, seq_len: int, dim: int) -> float:
    """Per-token cost of one decoder layer: its matmul weights plus QKᵀ and AV (``2·s·h``)."""
    return float(matmul_params + 2 * seq_len * dim)


def head_macs(vocab: int, dim: int) -> float:
    """Per-token cost of the output head and its softmax."""
    return float(vocab * dim + 4 * vocab)


def embedding_macs(dim: int) -> float:
    """Per-token cost of the embedding lookup (a copy of one row)."""
    return float(dim)


def partition_layers(n_layers: int, n_chunks: int, partition: str | Sequence[int] = "balanced",
                     costs: Sequence[float] | None = None, first_extra: float = 0.0,
                     last_extra: float = 0.0) -> list[int]:
    """Layer counts per chunk for ``partition`` = "balanced", "uniform" or an explicit list of counts.

    ``costs`` are the layers' costs (default: equal), ``first_extra``/``last_extra`` what the first chunk
    (embedding) and the last chunk (norm, head, loss) add. Raises ConfigError naming the bad value.
    """
    if n_layers < n_chunks:
        raise ConfigError(f"the model has {n_layers} layers but pp*virtual_stages={n_chunks} chunks need at "
                          f"least one each; use pp*virtual_stages <= {n_layers}")
    if isinstance(partition, (list, tuple)):
        counts = [int(c) for c in partition]
        if len(counts) != n_chunks or sum(counts) != n_layers or min(counts) < 1:
            raise ConfigError(f"partition={list(partition)}: give {n_chunks} positive layer counts (one per "
                              f"chunk, pp*virtual_stages) summing to {n_layers}")
        return counts
    if partition == "uniform":
        base, extra = divmod(n_layers, n_chunks)
        return [base + (1 if i >= n_chunks - extra else 0) for i in range(n_chunks)]
    if partition == "balanced":
        layer = tuple(float(c) for c in costs) if costs is not None else (1.0,) * n_layers
        if len(layer) != n_layers:
            raise ConfigError(f"costs: {len(layer)} layer costs for a model of {n_layers} layers")
        return list(_balanced(layer, n_chunks, float(first_extra), float(last_extra)))
    raise ConfigError(f"partition={partition!r}: use {' or '.join(map(repr, PARTITIONS))}, or a list of layer counts")


@lru_cache(maxsize=4096)
def _balanced(costs: tuple[float, ...], k: int, first: float, last: float) -> tuple[int, ...]:
    """The smallest bottleneck (binary search over every achievable chunk cost), then the back-filled cut."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    uniform = all(c == costs[0] for c in costs)
    if uniform:  # a chunk of j layers costs j·c (+ an extra): O(n) candidates
        sums = {j * costs[0] for j in range(1, n + 1)}
    else:
        sums = {prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)}
    candidates = sorted({s + e for s in sums for e in (0.0, first, last, first + last)})
    lo, hi = 0, len(candidates) - 1  # the largest candidate (everything in one chunk) is always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if _fill(prefix, k, first, last, candidates[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    cut = _fill(prefix, k, first, last, candidates[lo])
    assert cut is not None
    return cut


def _fill(prefix: list[float], k: int, first: float, last: float, bound: float) -> tuple[int, ...] | None:
    """Fill chunks from the last one backwards, each with as many layers as fit under ``bound`` (leaving one
    for every earlier chunk); None when the first chunk then exceeds ``bound``."""
    n = len(prefix) - 1
    limit = bound * (1 + _TOL) + _TOL
    counts = [0] * k
    end = n
    for j in range(k - 1, 0, -1):
        extra = last if j == k - 1 else 0.0
        start = end - 1  # at least one layer
        if prefix[end] - prefix[start] + extra > limit:
            return None
        while start - 1 >= j and prefix[end] - prefix[start - 1] + extra <= limit:
            start -= 1
        counts[j] = end - start
        end = start
    extra = first + (last if k == 1 else 0.0)
    if end < 1 or prefix[end] + extra > limit:
        return None
    counts[0] = end
    return tuple(counts)
