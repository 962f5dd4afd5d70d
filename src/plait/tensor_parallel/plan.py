"""Module-path tensor-parallel plans: which submodule becomes which parallel layer, applied from outside.

A plan maps glob patterns of module paths to styles:
  region         forward pre-hook that enters the TP region once (f, or the SP all-gather) for all
                 the column-parallel projections inside the module (Q, K, V or gate, up); under SP they
                 keep the input's sequence shard for the backward (plait.tensor_parallel.regather)
  colwise        column-parallel linear whose input comes from an enclosing region
  colwise_kv     like colwise for K/V; KV heads replicated when there are fewer than tp
  rowwise        row-parallel linear (all-reduce, or reduce-scatter with SP)
  vocab_embed    vocabulary-parallel embedding
  vocab_head     column-parallel output head over the (padded) vocabulary; logits stay sharded
  sp_norm        replicated norm; under SP it runs on sequence shards and its gradient is TP-partial
  tp_partial     replicated parameters used on a different part of the work on each TP rank (e.g. a
                 per-head norm shared by heads split over ranks): gradients summed over TP
A model family's plan lives beside its model (``plait.models.llama.TP_PLAN``); its adapter returns it.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from plait.distributed.context import ParallelContext
from plait.errors import ConfigError
from plait.tensor_parallel import comms
from plait.tensor_parallel.heads import ReplicatedHeadsLinear
from plait.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_tp_partial,
)
from plait.tensor_parallel.regather import attach


def _region_hook(ctx: ParallelContext, sequence_parallel: bool, regather: bool):
    group = ctx.tp_group

    def hook(module, args):
        x = args[0]
        if not sequence_parallel:
            return (comms.copy_to_tp(x, group), *args[1:])
        gathered = comms.gather_seq(x, group)
        if regather and torch.is_grad_enabled():  # the projections keep x, the shard (tensor_parallel.regather)
            attach(gathered, x, 1, group)
        return (gathered, *args[1:])

    return hook


def _convert(style: str, module: nn.Module, ctx: ParallelContext, sp: bool, n_kv_heads: int | None,
             path: str) -> nn.Module:
    if style == "vocab_embed":
        if not isinstance(module, nn.Embedding):
            raise ConfigError(f"tp_plan: {path!r} is a {type(module).__name__}; style 'vocab_embed' needs nn.Embedding")
        return VocabParallelEmbedding.from_dense(module, ctx, sequence_parallel=sp)
    if style not in ("colwise", "colwise_kv", "rowwise", "vocab_head"):
        raise ConfigError(f"unknown tensor-parallel style {style!r}")
    if not isinstance(module, nn.Linear):
        raise ConfigError(f"tp_plan: {path!r} is a {type(module).__name__}; style {style!r} needs nn.Linear")
    if style == "colwise":
        return ColumnParallelLinear.from_dense(module, ctx, input_comm=False)
    if style == "colwise_kv":
        if n_kv_heads is not None and n_kv_heads < ctx.tp_size:
            return ReplicatedHeadsLinear(module, n_kv_heads, ctx)
        return ColumnParallelLinear.from_dense(module, ctx, input_comm=False)
    if style == "rowwise":
        return RowParallelLinear.from_dense(module, ctx, sequence_parallel=sp)
    return ColumnParallelLinear.from_dense(module, ctx, sequence_parallel=sp, pad_output=True)  # vocab_head


def apply_tp_plan(model: nn.Module, plan: dict[str, str], ctx: ParallelContext, *, sequence_parallel: bool,
                  n_kv_heads: int | None = None, regather: bool = True) -> nn.Module:
    """Replace the submodules of ``model`` matched by ``plan`` with their parallel versions (in place).

    With ``sequence_parallel``, each region's projections keep its input's sequence shard for the backward and
    all-gather it again there (``regather``, plait.tensor_parallel.regather); ``regather=False`` keeps the
    gathered input instead, one collective fewer, for a model whose blocks are recomputed whole (the block
    keeps only its input: the gathered one lives only while its recomputed block's backward runs)."""
    paths = [name for name, _ in model.named_modules() if name]
    for path in paths:
        styles = [s for pattern, s in plan.items() if fnmatch.fnmatchcase(path, pattern)]
        if not styles:
            continue
        style = styles[0]
        module = model.get_submodule(path)
        if style == "region":
            if ctx.tp_size > 1:
                module.register_forward_pre_hook(_region_hook(ctx, sequence_parallel, regather))
        elif style in ("sp_norm", "tp_partial"):
            if ctx.tp_size > 1 and (sequence_parallel or style == "tp_partial"):
                for p in module.parameters():
                    mark_tp_partial(p)
        else:
            parent_path, _, child = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            setattr(parent, child, _convert(style, module, ctx, sequence_parallel, n_kv_heads, path))
    return model
