"""``plait.parallelize``: apply a layout (TP, SP, DP; PP via the pipeline runtime) to a plain model."""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from plait.data_parallel.reducer import GradReducer
from plait.distributed.context import ParallelContext
from plait.errors import ConfigError
from plait.models.llama import Llama
from plait.tensor_parallel import comms
from plait.tensor_parallel.layers import TPShardedModule, sync_tp_partial_grads
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
    if isinstance(model, Llama):
        check_llama_tp(model.config, ctx.tp_size)
    elif loss_fn is None:
        raise ConfigError("loss_fn is required for models other than plait.models.Llama: pass "
                          "loss_fn(output, target) -> mean loss of one micro-batch")
    elif ctx.tp_size > 1 and tp_plan is None:
        raise ConfigError(f"tp={ctx.tp_size} needs a tensor-parallel plan for {type(model).__name__}: pass "
                          "tp_plan={'module.path.*': 'colwise'|'rowwise'|...} or use tp=1")


def parallelize(model: nn.Module, ctx: ParallelContext, schedule: str = "1f1b", microbatches: int | None = None,
                virtual_stages: int = 1, sequence_parallel: bool = False, partition="balanced",
                activation_checkpointing: bool = False, loss_fn: Callable | None = None,
                tp_plan: dict[str, str] | None = None) -> ParallelModel:
    """Shard ``model`` (in place) over ``ctx``'s layout and return a ParallelModel that trains it.

    ``microbatches`` defaults to 1 without pipeline parallelism. ``loss_fn(output, target)`` must return
    the mean loss of one micro-batch; for ``plait.models.Llama`` the default is next-token cross-entropy
    on vocabulary-sharded logits (mean over non-ignored tokens of the global batch).
    """
    microbatches = max(1, ctx.pp_size) if microbatches is None else microbatches
    _check_args(model, ctx, microbatches, virtual_stages, loss_fn, tp_plan)
    if ctx.pp_size > 1 or virtual_stages > 1:
        from plait.pipeline.model import build_pipeline_model

        return build_pipeline_model(model, ctx, schedule=schedule, microbatches=microbatches,
                                    virtual_stages=virtual_stages, sequence_parallel=sequence_parallel,
                                    partition=partition, activation_checkpointing=activation_checkpointing,
                                    loss_fn=loss_fn, tp_plan=tp_plan)
    _shard(model, ctx, sequence_parallel, tp_plan)
    return ParallelModel(model, ctx, microbatches=microbatches, sequence_parallel=sequence_parallel,
                         loss_fn=loss_fn, activation_checkpointing=activation_checkpointing)


def _shard(model: nn.Module, ctx: ParallelContext, sequence_parallel: bool, tp_plan: dict | None) -> None:
    if isinstance(model, Llama):
        apply_tp_plan(model, tp_plan or LLAMA_TP_PLAN, ctx, sequence_parallel=sequence_parallel,
                      n_kv_heads=model.config.n_kv_heads)
        if model.config.tie_embeddings:
            model.lm_head.weight = model.embed_tokens.weight  # the same vocabulary shard
    elif tp_plan is not None:
        apply_tp_plan(model, tp_plan, ctx, sequence_parallel=sequence_parallel)
    model.to(ctx.device)


class ParallelModel:
    """A model sharded over a layout: ``train_step``, ``eval_step`` and full-tensor state dicts."""

    def __init__(self, module: nn.Module, ctx: ParallelContext, *, microbatches: int = 1,
                 sequence_parallel: bool = False, loss_fn: Callable | None = None,
                 activation_checkpointing: bool = False):
        self.module, self.ctx, self.microbatches = module, ctx, microbatches
        self.sequence_parallel = sequence_parallel
        self.token_loss = TokenLoss(ctx, module.config.vocab_size) if isinstance(module, Llama) else None
        self.loss_fn = loss_fn
        self.activation_checkpointing = activation_checkpointing
        self.reducer = GradReducer(list(self.parameters()), ctx, op="sum")

    # ----------------------------------------------------------------------------------------- params
    def parameters(self):
        """This rank's parameter shards (unique), for any torch optimizer."""
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    # ------------------------------------------------------------------------------------- training
    def _check_batch(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> None:
        if inputs.shape[0] % self.microbatches:
            raise ConfigError(f"the local batch size {inputs.shape[0]} is not divisible by microbatches="
                              f"{self.microbatches}; use a batch that is a multiple of it")
        if targets is not None and targets.shape[0] != inputs.shape[0]:
            raise ConfigError(f"targets have batch size {targets.shape[0]}, inputs {inputs.shape[0]}")
        if self.sequence_parallel and inputs.dim() > 1 and inputs.shape[1] % self.ctx.tp_size:
            raise ConfigError(f"sequence length {inputs.shape[1]} must be divisible by tp={self.ctx.tp_size} "
                              "with sequence_parallel=True")

    def _normaliser(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The divisor that turns this rank's summed losses into its share of the global mean loss."""
        if self.token_loss is None:
            return float(self.microbatches * self.ctx.dp_size)
        bad = self.token_loss.bad_ids(inputs, targets)
        if self.ctx.dp_size == 1:
            if bad:
                raise ConfigError(bad)
            return float(max(self.token_loss.count(targets), 1))
        stats = torch.tensor([float(self.token_loss.count(targets)), 1.0 if bad else 0.0])
        dist.all_reduce(stats, group=self.ctx.dp_group)  # one tiny collective: global count + any bad ids
        if stats[1] > 0:
            raise ConfigError(bad or "a data-parallel peer received token ids outside the vocabulary")
        return float(max(stats[0].item(), 1.0))

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.token_loss is not None:
            return self.token_loss(output, target)
        return self.loss_fn(output, target)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward over the local batch in micro-batches; returns the global mean loss.

        Replaces ``.grad`` of every local shard with the gradient of that global mean loss.
        """
        self._check_batch(inputs, targets)
        inputs, targets = inputs.to(self.ctx.device), targets.to(self.ctx.device)
        norm = self._normaliser(inputs, targets)
        self.zero_grad()
        total = torch.zeros((), dtype=torch.float64)
        for i, (x, y) in enumerate(zip(inputs.chunk(self.microbatches), targets.chunk(self.microbatches), strict=True)):
            if i == self.microbatches - 1:
                self.reducer.arm()
            loss = self._loss(self._forward(x), y) / norm
            loss.backward()
            total += loss.detach().double()
        self.reducer.finish()  # DP sum first: its buckets hold copies taken during backward
        sync_tp_partial_grads(self.parameters(), self.ctx)
        if self.ctx.dp_size > 1:
            dist.all_reduce(total, group=self.ctx.dp_group)
        return float(total)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.activation_checkpointing:
            return self.module(x)
        return torch.utils.checkpoint.checkpoint(self.module, x, use_reentrant=False)

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor) -> torch.Tensor:
        """The full model output (e.g. logits [B, S, V]) on every rank."""
        out = self.module(inputs.to(self.ctx.device))
        if self.token_loss is not None and self.ctx.tp_size > 1:
            out = comms.all_gather(out, out.dim() - 1, self.ctx.tp_group)[..., : self.token_loss.vocab_size]
        return out

    # ----------------------------------------------------------------------------------- state dicts
    def _owner(self, key: str) -> tuple[nn.Module, str]:
        path, _, name = key.rpartition(".")
        return (self.module.get_submodule(path) if path else self.module), name

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors (or their gradients) with the plain model's keys, on every rank (collective)."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in self.module.state_dict(keep_vars=True).items():
            local = tensor.grad if grads else tensor
            if local is None:
                local = torch.zeros_like(tensor)
            module, name = self._owner(key)
            if isinstance(module, TPShardedModule):
                out[key] = module.full_tensor(name, local).cpu()
            else:
                out[key] = local.detach().clone().cpu()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full tensors (keys of the plain model); each rank keeps its own shard. No collective."""
        own = self.module.state_dict(keep_vars=True)
        missing = sorted(set(own) - set(state_dict))
        if missing:
            raise ConfigError(f"state_dict is missing {len(missing)} keys, e.g. {missing[:3]}")
        for key, tensor in own.items():
            module, name = self._owner(key)
            if isinstance(module, TPShardedModule):
                module.load_full(name, state_dict[key].to(tensor.device))
            else:
                tensor.copy_(state_dict[key])


class _CallableModule(sys.modules[__name__].__class__):
    """Importing ``plait.parallelize`` (the module) rebinds the package attribute to it; making the module
    callable keeps ``plait.parallelize(model, ctx, ...)`` working whichever import ran first."""

    def __call__(self, *args, **kwargs) -> ParallelModel:
        return parallelize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
