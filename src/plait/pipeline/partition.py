"""Cut a plain model into contiguous pipeline chunks (uniform, balanced by cost, or explicit counts).

A model is seen as a sequence of named blocks applied one after the other. For ``Llama`` these are the
embedding, each decoder layer, the final norm and the head; only decoder layers count as *layers*: the
embedding always joins the first chunk and the norm + head (+ loss) the last, and ``balanced``
partitioning (``pipeline.balance``, shared with the planner) charges those chunks for them. Any
``nn.Sequential`` works too (every child is a layer).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from plait.errors import ConfigError
from plait.models.llama import Llama
from plait.pipeline.balance import embedding_macs, head_macs, layer_macs, partition_layers

#: activation recomputation the runtime offers: none, or whole layers recomputed in the backward
RECOMPUTE_MODES = ("none", "full")


def model_blocks(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], int, int]:
    """(named blocks in execution order, index of the first layer, number of layers)."""
    if isinstance(model, Llama):
        blocks = [("embed_tokens", model.embed_tokens)]
        blocks += [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
        blocks += [("norm", model.norm), ("lm_head", model.lm_head)]
        return blocks, 1, len(model.layers)
    if isinstance(model, nn.Sequential):
        blocks = [(name, child) for name, child in model.named_children()]
        return blocks, 0, len(blocks)
    raise ConfigError(f"cannot pipeline {type(model).__name__}: pass a plait.models.Llama or an nn.Sequential")


def layer_costs(model: nn.Module) -> tuple[list[float], float, float]:
    """Relative forward cost of each layer and the extra cost of the first and last chunk, per token
    (``pipeline.balance``: the planner costs a model the same way). A mixture-of-experts layer counts
    the experts a token uses (top-k of them) and its router."""
    if isinstance(model, Llama):  # from the config: the same whether or not the model is already sharded
        cfg = model.config
        hd = cfg.head_dim
        attention = 2 * cfg.dim * cfg.n_heads * hd + 2 * cfg.dim * cfg.n_kv_heads * hd
        mlp = 3 * cfg.dim * cfg.ffn_dim
        moe = cfg.top_k * mlp + cfg.dim * cfg.n_experts  # the experts a token uses, and the router
        costs = [layer_macs(attention + (moe if cfg.is_moe_layer(i) else mlp), cfg.max_seq_len, cfg.dim)
                 for i in range(cfg.n_layers)]
        return costs, embedding_macs(cfg.dim), head_macs(cfg.vocab_size, cfg.dim)
    costs = [float(sum(p.numel() for p in child.parameters()) + 1) for child in model.children()]
    return costs, 0.0, 0.0


class PipelineChunk(nn.Module):
    """A contiguous run of a model's blocks; keeps their original names for state dicts."""

    def __init__(self, index: int, named_blocks: list[tuple[str, nn.Module]], checkpointing: bool = False):
        super().__init__()
        self.index = index
        self.names = [n for n, _ in named_blocks]
        self.blocks = nn.ModuleList(b for _, b in named_blocks)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
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


def build_chunks(model: nn.Module, n_chunks: int, partition, checkpointing: bool) -> list[PipelineChunk]:
    """All ``n_chunks`` chunks of ``model`` (the caller keeps only its own)."""
    blocks, first_layer, n_layers = model_blocks(model)
    costs, first_extra, last_extra = layer_costs(model)
    counts = partition_layers(n_layers, n_chunks, partition, costs, first_extra, last_extra)
    layers = blocks[first_layer:first_layer + n_layers]
    chunks, start = [], 0
    for c, count in enumerate(counts):
        named = list(layers[start:start + count])
        if c == 0:
            named = blocks[:first_layer] + named
        if c == n_chunks - 1:
            named = named + blocks[first_layer + n_layers:]
        chunks.append(PipelineChunk(c, named, checkpointing))
        start += count
    return chunks
