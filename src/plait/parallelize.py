"""``plait.parallelize``: apply a layout (TP, SP, DP; PP via the pipeline runtime) to a plain model."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from plait.distributed.context import ParallelContext
from plait.errors import ConfigError
from plait.experts.layer import apply_expert_parallel, check_model_experts
from plait.models.llama import Llama
from plait.optim.precision import check_precision
from plait.parallel_model import ParallelModel
from plait.schedules import Schedule
from plait.tensor_parallel.loss import vocab_parallel_cross_entropy
from plait.tensor_parallel.plan import LLAMA_TP_PLAN, apply_tp_plan, check_llama_tp


class TokenLoss:
    """Next-token cross-entropy summed over tokens, on vocabulary-sharded logits; ids checked."""

    def __init__(self, ctx: ParallelContext, vocab_size: int, ignore_index: int = -100):
        self.ctx, self.vocab_size, self.ignore_index = ctx, vocab_size, ignore_index

    def __call__(self, logits_shard: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_shard, targets, self.ctx, ignore_index=self.ignore_index,
                                            vocab_size=self.vocab_size, reduction="sum")

    def count(self, targets: torch.Tensor) -> int:
        return int((targets != self.ignore_index).sum())

    def bad_ids(self, inputs: torch.Tensor, targets: torch.Tensor) -> str | None:
        """A message if token ids fall outside the vocabulary, else None (local check, no collective)."""
        for name, t in (("inputs", inputs), ("targets", targets)):
            valid = t if name == "inputs" else t[t != self.ignore_index]
            if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= self.vocab_size):
                return (f"{name} contain token ids outside the vocabulary [0, {self.vocab_size}) "
                        f"(min {int(valid.min())}, max {int(valid.max())})")
        return None


def _check_args(model: nn.Module, ctx: ParallelContext, microbatches: int, virtual_stages: int,
                loss_fn: Callable | None, tp_plan: dict | None) -> None:
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"microbatches={microbatches!r} must be a positive integer")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ConfigError(f"virtual_stages={virtual_stages!r} must be a positive integer")
    check_model_experts(model, ctx.ep_size)
    if isinstance(model, Llama):
        check_llama_tp(model.config, ctx.tp_size)
    elif loss_fn is None:
        raise ConfigError("loss_fn is required for models other than plait.models.Llama: pass "
                          "loss_fn(output, target) -> mean loss of one micro-batch")
    elif ctx.tp_size > 1 and tp_plan is None:
        raise ConfigError(f"tp={ctx.tp_size} needs a tensor-parallel plan for {type(model).__name__}: pass "
                          "tp_plan={'module.path.*': 'colwise'|'rowwise'|...} or use tp=1")


def parallelize(model: nn.Module, ctx: ParallelContext, schedule: str | Schedule = "1f1b",
                microbatches: int | None = None, virtual_stages: int = 1, sequence_parallel: bool = False,
                partition="balanced", activation_checkpointing: bool = False, loss_fn: Callable | None = None,
                tp_plan: dict[str, str] | None = None, precision: str = "fp32") -> ParallelModel:
    """Shard ``model`` (in place) over ``ctx``'s layout and return a ParallelModel that trains it.

    ``loss_fn(output, target)`` must return
    the mean loss of one micro-batch; for ``plait.models.Llama`` the default is next-token cross-entropy
    on vocabulary-sharded logits (mean over non-ignored tokens of the global batch). ``precision``:
    "fp32", or "bf16" weights and activations over fp32 master weights and gradients
    (plait.optim.precision). ``microbatches`` defaults to ``pp`` (1 without pipeline parallelism).
    ``schedule`` is a name (``plait.schedules.SCHEDULE_NAMES``) or a ``Schedule`` for ``pp`` ranks, e.g.
    ``build_schedule("interleaved-1f1b", pp, M, 2, rounds="padded")`` or one read from a CSV.

    A model too large for one device can be built on the meta device (``with torch.device("meta"):
    model = Llama(cfg)``): only this rank's shards are then allocated, uninitialised, and must be filled
    with ``pm.load_full_state_dict(...)`` or read slice by slice (``plait.train.shards.load_local``).
    """
    check_precision(precision)
    if microbatches is None:  # a given Schedule fixes M
        microbatches = getattr(schedule, "microbatches", max(1, ctx.pp_size))
    _check_args(model, ctx, microbatches, virtual_stages, loss_fn, tp_plan)
    token_loss = TokenLoss(ctx, model.config.vocab_size) if isinstance(model, Llama) else None
    _shard(model, ctx, sequence_parallel, tp_plan)
    if token_loss is not None:
        loss, normaliser, vocab = token_loss, partial(_token_normaliser, token_loss, ctx), token_loss.vocab_size
    else:
        loss, normaliser, vocab = loss_fn, partial(_rows_normaliser, microbatches, ctx), None
    return ParallelModel(model, ctx, schedule=schedule, microbatches=microbatches, virtual_stages=virtual_stages,
                         sequence_parallel=sequence_parallel, partition=partition,
                         activation_checkpointing=activation_checkpointing, loss=loss, normaliser=normaliser,
                         vocab_size=vocab, precision=precision)


def _token_normaliser(token_loss: TokenLoss, ctx: ParallelContext, inputs: torch.Tensor,
                      targets: torch.Tensor) -> tuple[float, float]:
    """(global count of non-ignored targets — the mean's divisor, global number of sequences).

    Raises ConfigError on every rank if any id is outside the vocabulary.
    """
    bad = token_loss.bad_ids(inputs, targets)
    if ctx.dp_size == 1:
        if bad:
            raise ConfigError(bad)
        return float(max(token_loss.count(targets), 1)), float(inputs.shape[0])
    stats = torch.tensor([float(token_loss.count(targets)), 1.0 if bad else 0.0, float(inputs.shape[0])],
                         device=ctx.device)
    dist.all_reduce(stats, group=ctx.dp_group)  # one tiny collective: global counts + any bad ids
    if stats[1] > 0:
        raise ConfigError(bad or "a data-parallel peer received token ids outside the vocabulary")
    return float(max(stats[0].item(), 1.0)), float(stats[2].item())


def _rows_normaliser(microbatches: int, ctx: ParallelContext, inputs: torch.Tensor,
                     targets: torch.Tensor) -> tuple[float, float]:
    """For a ``loss_fn`` that averages one micro-batch: (divisor, global rows) making the sum of the scaled
    micro-batch losses over every DP replica the mean over the global batch, even if replicas hold
    different numbers of rows (one tiny all-reduce when dp > 1)."""
    local = float(inputs.shape[0])
    if ctx.dp_size == 1:
        return float(microbatches), local
    rows = torch.tensor([local], device=ctx.device)
    dist.all_reduce(rows, group=ctx.dp_group)
    total = float(rows.item())
    return total * microbatches / local, total  # each micro-batch holds local/M of the total rows


def _shard(model: nn.Module, ctx: ParallelContext, sequence_parallel: bool, tp_plan: dict | None) -> None:
    if isinstance(model, Llama):
        apply_tp_plan(model, tp_plan or LLAMA_TP_PLAN, ctx, sequence_parallel=sequence_parallel,
                      n_kv_heads=model.config.n_kv_heads)
        if model.config.tie_embeddings:
            model.lm_head.weight = model.embed_tokens.weight  # the same vocabulary shard
    elif tp_plan is not None:
        apply_tp_plan(model, tp_plan, ctx, sequence_parallel=sequence_parallel)
    apply_expert_parallel(model, ctx, sequence_parallel)  # MoE layers (after TP: they enter TP themselves)
    # no .to(device) here: ParallelModel moves (or, from the meta device, materialises) only this rank's chunks


class _CallableModule(sys.modules[__name__].__class__):
    """Importing ``plait.parallelize`` (the module) rebinds the package attribute to it; making the module
    callable keeps ``plait.parallelize(model, ctx, ...)`` working whichever import ran first."""

    def __call__(self, *args, **kwargs) -> ParallelModel:
        return parallelize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
