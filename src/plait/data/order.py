"""The sample order: which window of which source is global sample ``g``, from (seed, g) alone.

A run's global batch ``k`` holds samples ``g = k·B .. k·B + B - 1``; every rank computes the samples of its own
rows with no state and no communication, so the order depends on the seed and the step, never on the layout,
and a resumed run continues it from the step number (the elastic determinism of MosaicML Streaming).

- One source of ``N`` windows: sample ``g`` lies in epoch ``e = g // N`` at position ``g % N``, and epoch ``e``
  visits the windows in a pseudo-random permutation keyed by (seed, source, e): a 4-round Feistel network on
  the next even power of two above ``N``, cycle-walked back into ``[0, N)`` (Black & Rogaway 2002, "Ciphers with
  arbitrary finite domains"; Luby & Rackoff 1988 for the rounds). It costs O(1) memory whatever the corpus
  size, and being defined here it does not change with numpy's generators.
- A weighted mixture: samples are dealt in blocks of ``BLOCK``; in every block source ``i`` gets exactly ``n_i``
  places (the weights by largest remainder), permuted per block. The ``j``-th sample of source ``i`` is then
  a closed form of ``g``, and each source runs through its own epochs (a small source repeats sooner).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plait.errors import ConfigError

BLOCK = 4096  # samples per mixture block: each source's share is exact to 1/BLOCK within every block
ROUNDS = 4


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele et al. 2014) on uint64 arrays: a bijective, well-mixing hash."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def key(*parts: int | np.ndarray) -> np.ndarray:
    """A 64-bit key of integers (scalars or equal-shaped arrays), e.g. (seed, source, epoch)."""
    h = np.uint64(0x9E3779B97F4A7C15)
    out = np.asarray(h, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for p in parts:
            out = _mix(out ^ (np.asarray(p).astype(np.uint64) + h))
    return out


def permute(index: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """Position ``index`` (int64 array, values in [0, n)) under the permutation of [0, n) keyed by ``keys``
    (uint64, the shape of ``index`` or a scalar)."""
    if n <= 1:
        return np.zeros_like(index)
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # domain 2^(2·half) >= n, at most 4n
    mask = np.uint64((1 << half) - 1)
    keys = np.broadcast_to(np.asarray(keys, dtype=np.uint64), index.shape)
    x = index.astype(np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():  # cycle walking: at most a few rounds (the domain is < 4n)
        left, right = x[todo] >> np.uint64(half), x[todo] & mask
        k = keys[todo]
        for r in range(ROUNDS):
            f = _mix(right ^ _mix(k + np.uint64(r))) & mask
            left, right = right, left ^ f
        x[todo] = (left << np.uint64(half)) | right
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


def shares(weights: list[float], block: int = BLOCK) -> list[int]:
    """Places per block of each source: ``weights`` normalised, by largest remainder, each at least 1."""
    if not weights or any(not w > 0 for w in weights):
        raise ConfigError(f"--data weights {weights}: each must be > 0")
    total = sum(weights)
    exact = [w / total * block for w in weights]
    n = [max(1, int(e)) for e in exact]
    by_remainder = sorted(range(len(n)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    i = 0
    while sum(n) < block:
        n[by_remainder[i % len(n)]] += 1
        i += 1
    while sum(n) > block:  # only when several sources were raised to 1
        j = max(range(len(n)), key=lambda i: n[i])
        n[j] -= 1
    return n


@dataclass(frozen=True)
class Order:
    """The sample order over sources of ``windows[i]`` windows each, mixed by ``weights``."""

    windows: tuple[int, ...]
    weights: tuple[float, ...]
    seed: int
    stream: int = 0  # 0: training; another value gives an independent order (the held-out batches)

    def __post_init__(self) -> None:
        if any(n < 1 for n in self.windows):
            raise ConfigError(f"every source needs at least one window, got {list(self.windows)}")
        object.__setattr__(self, "_shares", shares(list(self.weights)) if len(self.windows) > 1 else [BLOCK])

    def source_samples(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, j): which source global samples ``g`` come from and that source's own sample index."""
        g = np.asarray(g, dtype=np.int64)
        if len(self.windows) == 1:
            return np.zeros_like(g), g
        n = np.asarray(self._shares, dtype=np.int64)  # type: ignore[attr-defined]
        starts = np.concatenate([[0], np.cumsum(n)[:-1]])
        block, pos = g // BLOCK, g % BLOCK
        slot = permute(pos, BLOCK, key(self.seed, self.stream, 1 << 40, block))  # 1 << 40: no source index
        source = np.searchsorted(starts, slot, side="right") - 1
        return source, block * n[source] + slot - starts[source]

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source, epoch, window) of global samples ``g`` (int64 arrays of g's shape)."""
        source, j = self.source_samples(g)
        windows = np.asarray(self.windows, dtype=np.int64)[source]
        epoch, pos = j // windows, j % windows
        out = np.empty_like(pos)
        for i, n in enumerate(self.windows):
            sel = source == i
            if sel.any():
                out[sel] = permute(pos[sel], n, key(self.seed, self.stream, i, epoch[sel]))
        return source, epoch, out

    def epochs(self, samples: int) -> list[float]:
        """Passes over each source after ``samples`` global samples (a fraction: 1.5 = one and a half)."""
        if samples <= 0:
            return [0.0] * len(self.windows)
        if len(self.windows) == 1:
            return [samples / self.windows[0]]
        n = self._shares  # type: ignore[attr-defined]
        full, rest = divmod(samples, BLOCK)
        counts = [full * k for k in n]
        if rest:
            source, _ = self.source_samples(np.arange(full * BLOCK, samples))
            for i in range(len(n)):
                counts[i] += int((source == i).sum())
        return [c / w for c, w in zip(counts, self.windows, strict=True)]
