"""Cut a plain model into contiguous pipeline chunks (uniform, balanced by cost, or explicit counts).

A model is seen as a sequence of named blocks applied one after the other, as its family adapter gives
them (``plait.models.family.Blocks``): for a decoder the embedding, each layer, the final norm and the
head. Only the layers are counted: blocks before them join the first chunk and blocks after them (+ the
loss) the last, and ``balanced`` partitioning charges those chunks for them (``LayerCosts``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.errors import ConfigError
from plait.models.family import Blocks, LayerCosts

Partition = str | list[int] | tuple[int, ...]  # "balanced", "uniform", or layer counts per chunk


def partition_layers(n_layers: int, n_chunks: int, partition: Partition, costs: list[float] | None = None,
                     first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Layer counts per chunk for ``partition`` = "uniform", "balanced" or an explicit list."""
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
        return _balanced(costs or [1.0] * n_layers, n_chunks, first_extra, last_extra)
    raise ConfigError(f"partition={partition!r}: use 'balanced', 'uniform' or a list of layer counts")


def _balanced(costs: list[float], k: int, first: float, last: float) -> list[int]:
    """Contiguous split minimising the most expensive chunk (exact dynamic programme, O(k·n²))."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[j][i]: minimal max cost splitting the first i layers into j chunks
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for s in range(j - 1, i):
                cost = prefix[i] - prefix[s] + (first if j == 1 else 0.0) + (last if j == k else 0.0)
                value = max(best[j - 1][s], cost)
                if value < best[j][i] - 1e-12:
                    best[j][i], cut[j][i] = value, s
    counts, i = [], n
    for j in range(k, 0, -1):
        s = cut[j][i]
        counts.append(i - s)
        i = s
    return counts[::-1]


class PipelineChunk(nn.Module):
    """A contiguous run of a model's blocks; keeps their original names for state dicts.

    ``recompute="full"`` recomputes each block's forward during backward instead of storing its activations.
    """

    def __init__(self, index: int, named_blocks: list[tuple[str, nn.Module]], recompute: str = "none",
                 n_layers: int = 0):
        super().__init__()
        self.index, self.n_layers = index, n_layers
        self.names = [n for n, _ in named_blocks]
        self.blocks = nn.ModuleList(b for _, b in named_blocks)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute == "full" else block(x)
        return x

    def named_state(self) -> dict[str, torch.Tensor]:
        """State tensors under the plain model's keys (``layers.3.mlp.up_proj.weight``)."""
        out = {}
        for name, block in zip(self.names, self.blocks, strict=True):
            for key, value in block.state_dict(keep_vars=True).items():
                out[f"{name}.{key}"] = value
        return out

    def owner(self, key: str) -> tuple[nn.Module, str]:
        """The submodule and attribute name that hold plain-model key ``key``."""
        for name, block in zip(self.names, self.blocks, strict=True):
            if key.startswith(name + "."):
                path, _, attr = key[len(name) + 1:].rpartition(".")
                return (block.get_submodule(path) if path else block), attr
        raise KeyError(key)


def build_chunks(blocks: Blocks, costs: LayerCosts, n_chunks: int, partition: Partition,
                 recompute: str = "none") -> list[PipelineChunk]:
    """All ``n_chunks`` chunks of a model's ``blocks`` (the caller keeps only its own)."""
    counts = partition_layers(blocks.n_layers, n_chunks, partition, costs.layers, costs.first, costs.last)
    first, layers = blocks.first_layer, blocks.layers
    chunks, start = [], 0
    for c, count in enumerate(counts):
        named = list(layers[start:start + count])
        if c == 0:
            named = blocks.named[:first] + named
        if c == n_chunks - 1:
            named = named + blocks.named[first + blocks.n_layers:]
        chunks.append(PipelineChunk(c, named, recompute, count))
        start += count
    return chunks
