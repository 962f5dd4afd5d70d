"""``plait.parallelize``: apply a ParallelConfig (TP, SP, EP; PP and DP via ParallelModel) to a plain model."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from plait.context_parallel import apply_context_parallel, check_context_parallel
from plait.distributed.collectives import collective
from plait.distributed.context import ParallelContext
from plait.documents import Documents, apply_documents
from plait.errors import ConfigError, is_integer
from plait.experts.layer import apply_expert_parallel, check_model_experts
from plait.models.family import Family
from plait.models.registry import family_of
from plait.parallel_config import RECOMPUTE_MODES, ParallelConfig
from plait.parallel_model import LossFn, ParallelModel
from plait.pipeline.balance import partition_layers
from plait.pipeline.partition import Partition
from plait.recompute import recompute_attention
from plait.tensor_parallel.loss import vocab_parallel_cross_entropy
from plait.tensor_parallel.plan import apply_tp_plan

#: the dtypes of token ids: an embedding's indices are int64 or int32
IDS = (torch.int64, torch.int32)


class TokenLoss:
    """Next-token cross-entropy summed over tokens, on vocabulary-sharded logits; ids checked."""

    def __init__(self, ctx: ParallelContext, vocab_size: int, ignore_index: int = -100):
        self.ctx, self.vocab_size, self.ignore_index = ctx, vocab_size, ignore_index

    def __call__(self, logits_shard: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_shard, targets, self.ctx, ignore_index=self.ignore_index,
                                            vocab_size=self.vocab_size, reduction="sum")

    def check(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> tuple[int, str | None]:
        """(count of targets that are not ``ignore_index``, a message if the batch is not integer token ids
        [batch, seq] (int64 or int32, as an embedding takes) with targets of the same shape, or if ids fall outside
        the vocabulary, else None): local, no collective, one host read of the batch's extremes (no boolean
        indexing, whose output size would be a second read). ``targets`` None: an evaluation's inputs alone."""
        given = [("inputs", inputs)] + ([] if targets is None else [("targets", targets)])
        if inputs.dim() != 2 or any(t.shape != inputs.shape or t.dtype not in IDS for _, t in given):
            shown = ", ".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in given)
            return 0, (f"{shown}: a language model takes integer token ids [batch, seq]"
                       + ("" if targets is None else " and targets of the same shape"))
        kept = None if targets is None else targets != self.ignore_index
        if kept is not None:  # ignored targets read as 0, inside any vocabulary
            given[1] = ("targets", given[1][1].masked_fill(~kept, 0))
        named = [(name, t) for name, t in given if t.numel()]
        ends = [f(t).to(torch.long) for _, t in named for f in (torch.min, torch.max)]
        count = inputs.new_zeros((), dtype=torch.long) if kept is None else kept.sum()
        stats = torch.stack([count, *ends]).tolist()
        for i, (name, _) in enumerate(named):
            lo, hi = stats[1 + 2 * i], stats[2 + 2 * i]
            if lo < 0 or hi >= self.vocab_size:
                return stats[0], (f"{name} contain token ids outside the vocabulary [0, {self.vocab_size}) "
                                  f"(min {lo}, max {hi})")
        return stats[0], None

    def check_inputs(self, inputs: torch.Tensor) -> None:
        """Raise ConfigError unless ``inputs`` are token ids [batch, seq] within the vocabulary (local)."""
        bad = self.check(inputs, None)[1]
        if bad:
            raise ConfigError(bad)


def parallelize(model: nn.Module, ctx: ParallelContext, schedule: str | None = None, microbatches: int | None = None,
                virtual_stages: int | None = None, sequence_parallel: bool | None = None,
                partition: Partition = "balanced", activation_checkpointing: bool | str | None = None,
                loss_fn: LossFn | None = None, tp_plan: dict[str, str] | None = None, precision: str | None = None,
                *, zero: int | None = None, config: ParallelConfig | None = None,
                document_eos: int | None = None) -> ParallelModel:
    """Shard ``model`` (in place) over ``ctx``'s layout and return a ParallelModel that trains it.

    The settings come from ``config`` (a ParallelConfig; default: the one ``plait.init`` made ``ctx`` from),
    overridden by any keyword given: ``schedule``, ``microbatches`` (default ``pp``), ``virtual_stages``
    (default: the schedule's), ``sequence_parallel``, ``activation_checkpointing`` (True/False or a recompute
    mode: "none"; "selective", only the attention cores, plait.recompute; "full", whole blocks) and
    ``precision`` ("fp32", or "bf16" weights and activations over fp32 master
    weights and gradients, plait.optim.precision) and ``zero`` (3: ZeRO-3, each data-parallel rank keeps 1/dp of
    the parameters of its pipeline stage, gathered per block and micro-batch; any schedule without a split backward:
    1f1b, gpipe, interleaved-1f1b, looped-bfs; train it with
    ``ParallelOptimizer(pm, ..., zero=3)``; 0-2 only concern the optimizer). ``config``'s sizes must be ctx's.
    ``document_eos``: the end-of-document token of packed samples; each token then attends only to the earlier
    tokens of its own document, positions restart at each document and the target after each end-of-document
    token is left out of the loss (plait.documents; None, the default: attention over the whole sample).

    The model's family adapter (plait.models.family) says how to cut it into pipeline blocks, its tensor-
    parallel plan and its default loss. Language models (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE) train on
    next-token cross-entropy over vocabulary-sharded logits (mean over the non-ignored tokens of the global
    batch); any ``nn.Sequential`` works too, given ``loss_fn(output, target)`` returning the mean loss of one
    micro-batch (and ``tp_plan`` for tp > 1). ``partition``: "balanced", "uniform" or layer counts per chunk.

    A model too large for one device can be built on the meta device (``with torch.device("meta"):
    model = Llama(cfg)``): only this rank's shards are then allocated, uninitialised, and must be filled
    with ``pm.load_full_state_dict(...)`` or read slice by slice (``plait.checkpoint.shards.load_local``).
    """
    cfg = _merged_config(ctx, config, schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages,
                         sequence_parallel=sequence_parallel, recompute=_recompute(activation_checkpointing),
                         precision=precision, zero=zero)
    family = family_of(model)
    _check_args(model, family, ctx, loss_fn, tp_plan)
    _check_pipeline(model, family, cfg, partition)
    vocab = family.vocab_size(getattr(model, "config", None)) if loss_fn is None else None
    _check_documents(document_eos, vocab)
    documents = Documents(document_eos, cfg.num_microbatches, ctx.device, ctx.cp_size, ctx.cp_rank)
    if cfg.recompute == "selective":  # the attention modules themselves stay when their projections are sharded
        recompute_attention(family.attention_modules(model), type(model).__name__)
    if ctx.cp_size > 1:  # replaces the (recomputed) core: CP attention keeps no probabilities
        apply_context_parallel(family.attention_modules(model), ctx, cfg.cp_comm, family.attention_windows(model),
                               type(model).__name__, documents if document_eos is not None else None)
    if document_eos is not None:  # after CP and recomputation: the rope (and cp = 1 core) they left
        apply_documents(family.attention_modules(model), documents, ctx.cp_size, type(model).__name__)
    # whole blocks recomputed keep only their input: their projections keep the gathered input, no re-gather
    _shard(model, family, ctx, cfg.sequence_parallel, tp_plan, regather=cfg.recompute != "full")
    if loss_fn is not None:
        return ParallelModel(model, ctx, cfg, family=family, partition=partition, loss=loss_fn, vocab_size=None,
                             normaliser=partial(_rows_normaliser, cfg.num_microbatches, ctx), documents=documents)
    assert vocab is not None, f"{family.name}: a next-token loss needs a vocabulary size"
    token_loss = TokenLoss(ctx, vocab)
    return ParallelModel(model, ctx, cfg, family=family, partition=partition, loss=token_loss, vocab_size=vocab,
                         normaliser=partial(_token_normaliser, token_loss, ctx), check_inputs=token_loss.check_inputs,
                         documents=documents)


def _recompute(activation_checkpointing: bool | str | None) -> str | None:
    if activation_checkpointing is None or isinstance(activation_checkpointing, str):
        return activation_checkpointing  # a recompute mode, checked by ParallelConfig
    if isinstance(activation_checkpointing, bool):
        return "full" if activation_checkpointing else "none"
    raise ConfigError(f"activation_checkpointing={activation_checkpointing!r}: use True, False or a recompute mode "
                      f"({', '.join(RECOMPUTE_MODES)})")


def _merged_config(ctx: ParallelContext, config: ParallelConfig | None, **overrides) -> ParallelConfig:
    """``config`` (or ctx's) with the keywords given; its sizes must be the context's."""
    base = ctx.config if config is None else config.resolve(ctx.world_size)
    sizes = ("tp", "cp", "pp", "dp", "ep", "expert_tp")
    for name in sizes:
        if getattr(base, name) != getattr(ctx.config, name):
            raise ConfigError(f"config.{name}={getattr(base, name)} but the context was initialised with "
                              f"{name}={getattr(ctx.config, name)}; pass the same layout to plait.init")
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def _check_args(model: nn.Module, family: Family, ctx: ParallelContext, loss_fn: LossFn | None,
                tp_plan: dict | None) -> None:
    check_model_experts(model, ctx.ep_size)
    if ctx.cp_size > 1:
        check_context_parallel(model, ctx.cp_size, loss_fn)
    family.check_tp(getattr(model, "config", None), ctx.tp_size)
    if family.loss is None and loss_fn is None:
        raise ConfigError(f"loss_fn is required for {type(model).__name__} ({family.name} models have no default "
                          "loss): pass loss_fn(output, target) -> mean loss of one micro-batch")
    if family.loss == "next_token" and loss_fn is not None and ctx.tp_size > 1:
        raise ConfigError(f"loss_fn with tp={ctx.tp_size}: {type(model).__name__} produces vocabulary-sharded "
                          "logits; leave loss_fn=None for next-token cross-entropy on the shards")
    if ctx.tp_size > 1 and tp_plan is None and family.tp_plan(model) is None:
        raise ConfigError(f"tp={ctx.tp_size} needs a tensor-parallel plan for {type(model).__name__}: pass "
                          "tp_plan={'module.path.*': 'colwise'|'rowwise'|...} or use tp=1")


def _check_documents(eos: int | None, vocab: int | None) -> None:
    """ConfigError unless ``eos`` is None or a token id of the model's vocabulary with its next-token loss."""
    if eos is None:
        return
    if vocab is None:
        raise ConfigError(f"document_eos={eos!r}: document masking needs a language model's next-token loss "
                          "(loss_fn=None); leave document_eos=None with a custom loss_fn")
    if not is_integer(eos) or not 0 <= eos < vocab:
        raise ConfigError(f"document_eos={eos!r}: give the end-of-document token id, an integer in [0, {vocab}), "
                          "or None (no document masking)")


def _check_pipeline(model: nn.Module, family: Family, cfg: ParallelConfig, partition: Partition) -> None:
    """Build the schedule and cut the layers once, so that a schedule or partition that does not fit raises its
    ConfigError before the model is sharded in place (ParallelModel cuts them again, on the sharded model)."""
    blocks, costs = family.blocks(model), family.layer_costs(model)
    partition_layers(blocks.n_layers, cfg.pipeline_schedule().num_stages, partition, costs.layers, costs.first,
                     costs.last)


def _token_normaliser(token_loss: TokenLoss, ctx: ParallelContext, inputs: torch.Tensor,
                      targets: torch.Tensor) -> tuple[float, float]:
    """(global count of non-ignored targets — the mean's divisor, 0 when every target is ignored —, global
    number of sequences).

    Raises ConfigError on every rank if any id is outside the vocabulary.
    """
    count, bad = token_loss.check(inputs, targets)
    if ctx.dp_size == 1:
        if bad:
            raise ConfigError(bad)
        return float(count), float(inputs.shape[0])
    stats = torch.tensor([float(count), 1.0 if bad else 0.0, float(inputs.shape[0])],
                         device=ctx.device)
    collective("dp all-reduce of the batch's token counts", ctx.dp_group,  # one tiny collective: global counts
               lambda: dist.all_reduce(stats, group=ctx.dp_group))  # and any bad ids
    count, bad_anywhere, rows = stats.tolist()  # one host read
    if bad_anywhere > 0:
        raise ConfigError(bad or "a data-parallel peer received token ids outside the vocabulary")
    return count, rows


def _rows_normaliser(microbatches: int, ctx: ParallelContext, inputs: torch.Tensor,
                     targets: torch.Tensor) -> tuple[float, float]:
    """For a ``loss_fn`` that averages one micro-batch: (divisor, global rows) making the sum of the scaled
    micro-batch losses over every DP replica the mean over the global batch, even if replicas hold
    different numbers of rows (one tiny all-reduce when dp > 1)."""
    local = float(inputs.shape[0])
    if ctx.dp_size == 1:
        return float(microbatches), local
    rows = torch.tensor([local], device=ctx.device)
    group = ctx.dp_group
    collective("dp all-reduce of the batch's row counts", group, lambda: dist.all_reduce(rows, group=group))
    total = float(rows.tolist()[0])
    return total * microbatches / local, total  # each micro-batch holds local/M of the total rows


def _shard(model: nn.Module, family: Family, ctx: ParallelContext, sequence_parallel: bool,
           tp_plan: dict | None, regather: bool) -> None:
    plan = tp_plan if tp_plan is not None else family.tp_plan(model)
    if plan is not None:
        apply_tp_plan(model, plan, ctx, sequence_parallel=sequence_parallel,
                      n_kv_heads=family.kv_heads(getattr(model, "config", None)), regather=regather)
        family.tie_weights(model)  # a tied head keeps the same vocabulary shard as the embedding
    apply_expert_parallel(model, ctx, sequence_parallel)  # MoE layers (after TP: they enter TP themselves)
    # no .to(device) here: ParallelModel moves (or, from the meta device, materialises) only this rank's chunks
