"""Cut a plain model into contiguous pipeline chunks (uniform, balanced by cost, or explicit counts).

A model is seen as a sequence of named blocks applied one after the other, as its family adapter gives
them (``plait.models.family.Blocks``): for a decoder the embedding, each layer, the final norm and the
head. Only the layers are counted: blocks before them join the first chunk and blocks after them (+ the
loss) the last, and ``balanced`` partitioning charges those chunks for them (``LayerCosts``). The counts
come from ``pipeline.balance``, the function the planner cuts with too.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.distributed.collectives import collective
from plait.errors import ConfigError
from plait.models.family import Blocks, LayerCosts
from plait.pipeline.balance import partition_layers
from plait.tensor_parallel.layers import TPShardedModule

if TYPE_CHECKING:
    from plait.distributed.context import ParallelContext

Partition = str | list[int] | tuple[int, ...]  # "balanced", "uniform", or layer counts per chunk


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

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the full tensors under the plain model's keys (a tensor-parallel shard at its full size)."""
        out = {}
        for key, tensor in self.named_state().items():
            module, name = self.owner(key)
            out[key] = module.full_shape(name, tensor) if isinstance(module, TPShardedModule) else tuple(tensor.shape)
        return out

    def owner(self, key: str) -> tuple[nn.Module, str]:
        """The submodule and attribute name that hold plain-model key ``key``."""
        for name, block in zip(self.names, self.blocks, strict=True):
            if key.startswith(name + "."):
                path, _, attr = key[len(name) + 1:].rpartition(".")
                return (block.get_submodule(path) if path else block), attr
        raise KeyError(key)


def named_parameters(chunks: Iterable[PipelineChunk]) -> list[tuple[str, nn.Parameter]]:
    """(plain-model key, parameter) of every parameter of ``chunks``, each once (a tied one under its first key)."""
    seen: dict[int, tuple[str, nn.Parameter]] = {}
    for chunk in chunks:
        for key, p in chunk.named_state().items():
            if isinstance(p, nn.Parameter):
                seen.setdefault(id(p), (key, p))
    return list(seen.values())


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


def check_full_state(state_dict: dict[str, torch.Tensor], keys: Iterable[str],
                     shapes: dict[str, tuple[int, ...]]) -> None:
    """Refuse (ConfigError) a full state dict whose keys are not exactly ``keys``, or whose tensors under
    ``shapes``' keys (the chunks' ``full_shapes``) are shaped otherwise, as torch's strict ``load_state_dict``."""
    missing, unknown = sorted(set(keys) - set(state_dict)), sorted(set(state_dict) - set(keys))
    if missing or unknown:
        said = [f"{say} {len(ks)} keys, e.g. {ks[:3]}" for say, ks in (("lacks", missing), ("adds", unknown)) if ks]
        raise ConfigError(f"state_dict {' and '.join(said)}: give the plain model's state_dict() keys")
    wrong = [f"{k}: {tuple(state_dict[k].shape)}, expected {s}" for k, s in shapes.items()
             if tuple(state_dict[k].shape) != s]
    if wrong:
        raise ConfigError(f"state_dict has {len(wrong)} tensors shaped unlike this model's, e.g. {wrong[:3]}")


def gather_full_state(local: dict[str, torch.Tensor], ctx: ParallelContext,
                      keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """``local`` (this rank's full tensors under plain-model keys) with those of its EP peers (other experts) and
    PP peers (other layers) added: the whole model's, under ``keys`` in their order, on every rank (collective over
    the EP and PP groups)."""
    for axis, size, group in (("ep", ctx.ep_size, ctx.ep_group), ("pp", ctx.pp_size, ctx.pp_group)):
        if size > 1:
            parts: list = [None] * size
            collective(f"{axis} all-gather of the full state", group,
                       partial(dist.all_gather_object, parts, local, group=group))
            for part in parts:
                for k, v in part.items():
                    local.setdefault(k, v)
    return {k: local[k] for k in keys}
