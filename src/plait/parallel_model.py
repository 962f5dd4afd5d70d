"""``ParallelModel``: a model sharded over TP x PP x DP that trains with a pipeline schedule.

Without pipeline parallelism it is the same machinery with one chunk (the schedule then only orders
the micro-batches of gradient accumulation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from plait import devices, memory, weight_grad
from plait.context_parallel import gather_sequence, shard_sequence
from plait.data_parallel.param_shards import ParamShards
from plait.data_parallel.reducer import Bucket, GradReducer, refuse_sharded_grads
from plait.data_parallel.zero3 import Zero3
from plait.distributed.collectives import collective
from plait.distributed.context import ParallelContext
from plait.distributed.same_batch import check_same_batch
from plait.experts.layer import plain_state_keys
from plait.experts.load import ExpertLoad, RoutingTally
from plait.models.family import Family
from plait.models.moe import has_aux_losses
from plait.optim.precision import StepCast
from plait.parallel_config import ParallelConfig
from plait.pipeline.executor import Executor, StepIO, StepStats, final_backward_index
from plait.pipeline.p2p import Transport
from plait.pipeline.partition import (
    Partition,
    PipelineChunk,
    build_chunks,
    check_full_state,
    gather_full_state,
    named_parameters,
)
from plait.pipeline.ties import TiedWeights
from plait.schedules import Schedule
from plait.tensor_parallel.layers import TPShardedModule, is_tp_partial, sum_over_tp
from plait.tensor_parallel.loss import full_logits

if TYPE_CHECKING:
    from plait.documents import Documents
    from plait.pipeline.trace import TraceReport

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: (inputs, targets) of a step -> (divisor of the summed micro-batch losses, global number of rows); the
#: next-token loss's divisor is the count of targets in the loss, 0 when every one is ignored
Normaliser = Callable[[torch.Tensor, torch.Tensor], tuple[float, float]]


class ParallelModel:
    """Train and evaluate a sharded model: ``train_step``, ``eval_step``, full-tensor state dicts."""

    def __init__(self, model: nn.Module, ctx: ParallelContext, config: ParallelConfig, *, family: Family,
                 partition: Partition, loss: LossFn, normaliser: Normaliser, vocab_size: int | None,
                 documents: Documents, check_inputs: Callable[[torch.Tensor], None] | None = None):
        self.ctx, self.config, self.family, self.documents = ctx, config, family, documents  # plait.documents
        self.model_config = getattr(model, "config", None)  # the plain model's own config (e.g. LlamaConfig)
        self._loss, self._normaliser = loss, normaliser
        self._check_inputs = check_inputs  # eval_step's inputs: raises ConfigError (train_step's: the normaliser)
        self.vocab_size = vocab_size  # set: outputs are vocabulary-sharded logits (gathered by eval_step)
        self.schedule: Schedule = config.pipeline_schedule()
        self.plain_keys = plain_state_keys(model)  # as before sharding (all experts included)
        self.has_aux, self.last_aux_loss = has_aux_losses(model), 0.0  # MoE layers' load-balancing losses
        self.routing = RoutingTally(model)
        self.last_expert_load: ExpertLoad | None = None  # the last step's assignments per expert (MoE layers)
        self.last_loss_targets: int | None = None  # targets in the last step's loss (None: a custom loss_fn)
        all_chunks = build_chunks(family.blocks(model), family.layer_costs(model), self.schedule.num_stages,
                                  partition, config.recompute)
        self.partition = [c.n_layers for c in all_chunks]
        mine = self.schedule.stages_of_rank(ctx.pp_rank)
        self.chunks: dict[int, PipelineChunk] = {c: all_chunks[c] for c in mine}
        self.ties = TiedWeights(all_chunks, self.schedule, ctx)
        self.full_shapes = {k: shape for c in all_chunks for k, shape in c.full_shapes().items()}  # every stage's
        del all_chunks
        self.from_meta = any(t.is_meta for c in self.chunks.values() for t in [*c.parameters(), *c.buffers()])
        for chunk in self.chunks.values():  # only this rank's chunks ever reach its device
            devices.materialize(chunk, ctx.device) if self.from_meta else chunk.to(ctx.device)
        needs_split = any(a.kind == "I" for row in self.schedule.actions for a in row)
        self.store = weight_grad.WeightGradStore() if needs_split else None
        if self.store is not None:
            for chunk in self.chunks.values():
                weight_grad.install(chunk, self.store)
        self.cast = StepCast(self.chunks, config.precision)  # bf16 copies of the fp32 masters per step
        self.zero3 = Zero3(self.chunks, ctx, self.cast, self.schedule) \
            if config.zero == 3 else None  # parameters sharded too (plait.data_parallel.zero3)
        self.param_shards: ParamShards | None = self.zero3.shards if self.zero3 is not None else None
        self.reducers = {min(self.chunks): self.zero3.reducer} if self.zero3 is not None else self._build_reducers()
        if self.zero3 is None:  # a bucket's bf16 copies hand their gradients straight to its buffer
            buckets = [(r, b) for r in self.reducers.values() for b in r.buckets]
            # reduced over other ranks: hand over as soon as complete, so the reduction overlaps the backward
            # (not under a split backward, whose weight-gradient store defers leaf weights past autograd's hooks)
            early = frozenset(i for i, (_, b) in enumerate(buckets) if b.size > 1 and self.store is None)
            self.cast.route([(b.params, partial(r.take, b)) for r, b in buckets], early)
        self.transport = Transport(self.schedule.num_stages, self.microbatches, ctx.device, ctx.timeout_s,
                                   group=ctx.p2p_group)
        self.executor = Executor(self.schedule, ctx.pp_rank, ctx.pp_peer, self.chunks, self.transport, self.store,
                                 self.reducers if self.zero3 is None else self.zero3.reducers)  # ZeRO-3: one, shared
        self._input_shape: tuple | None = None
        self._checked_shapes: tuple | None = None  # the batch shapes check_same_batch last passed
        self.last_stats: StepStats | None = None
        self._optimizer: memory.Optimizer | None = None  # attach_optimizer: whose state memory_report counts
        self.activations_peak: int | None = None  # bytes, of the last step that measured it
        self.device_peak: int | None = None  # the device allocator's peak bytes over that step (GPUs only)
        # the parameter set is fixed from here on (the buckets and ties are laid out over it): listed once
        self._params = tuple({id(p): p for chunk in self.chunks.values() for p in chunk.parameters()}.values())

    @property
    def microbatches(self) -> int:
        return self.config.num_microbatches

    @property
    def sequence_parallel(self) -> bool:
        return self.config.sequence_parallel

    def _build_reducers(self) -> dict[int, GradReducer]:
        """One DP reducer per chunk; a parameter shared by two chunks goes with the later-finishing one."""
        last = final_backward_index(self.schedule.actions[self.ctx.pp_rank])
        order = sorted(self.chunks, key=lambda c: last.get(c, -1))  # by when their last backward runs
        owner: dict[int, int] = {}
        params: dict[int, nn.Parameter] = {}
        for c in order:  # later-finishing chunks overwrite earlier ones
            for p in self.chunks[c].parameters():
                owner[id(p)], params[id(p)] = c, p
        alone = frozenset(id(p) for p, _ in self.ties.pairs)  # tied copies: a bucket each (shards line up)
        return {c: GradReducer([p for i, p in params.items() if owner[i] == c], self.ctx, alone=alone)
                for c in self.chunks}

    def full_parameters(self, gather: bool = True, write_back: bool = False) -> AbstractContextManager:
        """Under ZeRO-3, every local parameter whole in float32 for the duration of a ``with`` block (``gather``:
        from the shards, a collective; ``write_back``: into the shards afterwards); otherwise nothing to do."""
        return nullcontext() if self.zero3 is None else self.zero3.full(gather=gather, write_back=write_back)

    def _gathering(self) -> AbstractContextManager:
        """A step's forward/backward under ZeRO-3: measures the gathered peak, frees what is left at the end."""
        return nullcontext() if self.zero3 is None else self.zero3.step()

    # ------------------------------------------------------------------------------------- gradients
    def set_grad_reduction(self, mode: str) -> None:
        """How ``train_step`` reduces gradients over data parallelism (``data_parallel.reducer.MODES``):
        "all-reduce" (the default: ``.grad`` holds the sum), "reduce-scatter" (ZeRO-1) or
        "reduce-scatter-free" (ZeRO-2): each DP rank then holds only the sum of its shard of every bucket
        (``grad_buckets``). A sharded optimizer (plait.optim.ParallelOptimizer) sets it."""
        for reducer in self.reducers.values():
            reducer.set_mode(mode)

    def grad_buckets(self) -> list[tuple[GradReducer, Bucket]]:
        """Every gradient bucket of this rank, with the reducer that reads it (``shard``, ``region``)."""
        return [(r, b) for r in self.reducers.values() for b in r.buckets]

    def _grad_pieces(self, wanted) -> list[torch.Tensor]:
        return [t for r in self.reducers.values() for t in r.pieces(wanted)]

    @torch.no_grad()
    def store_params(self, dtype: torch.dtype) -> None:
        """Keep the floating-point parameters in ``dtype`` (bf16 when a ZeRO optimizer holds the fp32
        masters; plait.optim.precision)."""
        for p in self._params:
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        self.cast.set_storage(dtype)

    def attach_optimizer(self, optimizer: memory.Optimizer) -> None:
        """The optimizer whose state ``memory_report`` counts (``memory_bytes()``, or its state tensors) and whose
        fp32 masters ``load_full_state_dict`` sets; the last one attached (``attached_optimizer``) is the model's."""
        self._optimizer = optimizer

    @property
    def attached_optimizer(self) -> memory.Optimizer | None:
        return self._optimizer

    def memory_report(self) -> dict[str, int | None]:
        """Bytes on this rank: ``params`` (local shards), ``grads`` (gradient buffers and shards held now),
        ``optimizer`` (the attached optimizer's state; 0 without one) and ``activations_peak`` (most bytes of
        tensors saved for backward at once during the last step that measured it: the first ``train_step``
        and any with ``measure_memory=True``; None before). Each storage counts once. On a GPU also ``device_peak``:
        the device allocator's peak bytes during that step (everything: weights, buffers, workspaces). Under
        ZeRO-3 ``params`` are the float32 shards held between steps and ``params_gathered_peak`` the most bytes of
        gathered parameters held at once during the last step (None otherwise)."""
        grads = [t for r in self.reducers.values() for t in r.grad_tensors()]
        z = self.zero3
        grads += [p.grad for p in [*self._params, *(z.held() if z else [])] if p.grad is not None]
        out = memory.report([*self._params, *(z.held() if z else [])], grads, self._optimizer, self.activations_peak)
        out["params_gathered_peak"] = z.gathered_peak if z else None
        if self.device_peak is not None:  # a GPU: the caching allocator's own peak over that step
            out["device_peak"] = self.device_peak
        return out

    # ------------------------------------------------------------------------------------ parameters
    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameter shards (each once; ZeRO-3: the float32 bucket shards), for any torch optimizer."""
        return iter(self.zero3.held() if self.zero3 else self._params)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``parameters()`` under their plain-model names; under ZeRO-3 a ConfigError (``Zero3.refuse_names``)."""
        return self.named_model_parameters() if self.zero3 is None else self.zero3.refuse_names()

    def named_model_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(plain-model name, parameter) of the model's parameters on this rank (TP slices), each once; under ZeRO-3
        empty between steps (whole in ``full_parameters()``) and not what an optimizer steps (``parameters()``)."""
        return iter(named_parameters(self.chunks.values()))

    @property
    def precision(self) -> str:
        """Either "fp32" or "bf16" (bf16 weights/activations per step over fp32 masters: plait.optim.precision)."""
        return self.cast.precision

    def set_precision(self, precision: str) -> None:
        if self.zero3 is not None:  # the shards stay float32, gathered in the new dtype
            self.zero3.set_precision(precision, self.cast)
        else:
            self.cast.set(precision)  # refuses a change once ZeRO keeps the parameters in bf16
        self.config = replace(self.config, precision=precision)

    def zero_grad(self) -> None:
        for reducer in self.reducers.values():
            reducer.zero_grad()
        for p in [*self._params, *(self.zero3.held() if self.zero3 else [])]:
            p.grad = None

    # -------------------------------------------------------------------------------------- training
    def _check_batch(self, inputs: torch.Tensor, targets: torch.Tensor | None) -> None:
        self.ctx.check_open()  # closed: every rank refuses here alike, not the first to reach a group mid-step
        shapes = (tuple(inputs.shape), None if targets is None else tuple(targets.shape))
        self.config.check_batch(*shapes)
        if targets is None and self._check_inputs is not None:  # every rank of a replica, before any collective
            self._check_inputs(inputs)
        if shapes != self._checked_shapes:  # the first step and each new shape: one small all-gather over the world
            check_same_batch(self.ctx, inputs, targets)
            self._checked_shapes = shapes

    def _split(self, inputs: torch.Tensor) -> list[torch.Tensor]:
        if tuple(inputs.shape) != self._input_shape:  # new sequence length: shapes are negotiated again
            self.transport.reset_shapes()
            self._input_shape = tuple(inputs.shape)
        return list(inputs.to(self.ctx.device).chunk(self.microbatches))

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, trace: bool = False,
                   measure_memory: bool | None = None) -> float:
        """One forward and backward over the local batch; returns the global mean loss on every rank.

        Replaces ``.grad`` of every local shard with the gradient of that loss (under a ZeRO optimizer the
        reduced gradient is sharded instead: ``set_grad_reduction``). ``trace=True`` records the measured
        start/end of every action (``last_stats.timeline``). ``measure_memory`` measures the peak of saved
        activations (``memory_report``); None: on the first step only (the hooks cost a little per tensor).
        A batch whose every target is ``ignore_index`` has a loss of 0.0 and zero gradients: there is no
        mean to take, and ``last_loss_targets`` (the global count of targets in the loss) is then 0.
        """
        self._check_batch(inputs, targets)
        targets = self.documents.mask_targets(inputs, targets)  # masking: the target after an EOS is not in the loss
        norm, global_rows = self._normaliser(inputs, targets)  # over full rows: the same on every CP rank
        self.last_loss_targets = int(norm) if self.vocab_size is not None else None
        norm, select = max(norm, 1.0), self.documents.start(inputs)  # select: each micro-batch's documents
        inputs, targets = self._my_tokens(inputs), self._my_tokens(targets)
        self.zero_grad()
        for reducer in self.reducers.values():
            reducer.point_grads()
        mb_inputs, mb_targets = self._split(inputs), list(targets.to(self.ctx.device).chunk(self.microbatches))
        io = StepIO(mb_inputs, mb_targets, lambda out, y: self._loss(out, y) / norm, select=select)
        if self.has_aux:  # the batch mean over sequences, as the plain model's loss (plait.models.moe)
            self.routing.start(self.ctx.device)
            io.aux_fn = self.routing.aux_fn(1.0 / global_rows)
        if trace and self.ctx.pp_size > 1:  # a shared time origin for the measured timeline
            collective("pp barrier of a traced step", self.ctx.pp_group, partial(dist.barrier, group=self.ctx.pp_group))
        measure = self.activations_peak is None if measure_memory is None else measure_memory
        if self._loss_by_p2p():  # the last stage sends the loss once known: no collective ends the step
            if self._holds_loss():
                io.loss_to = [self.ctx.pp_peer(r) for r in range(self.ctx.pp_size) if r != self.ctx.pp_rank]
            else:
                io.loss_from = self.ctx.pp_peer(self.schedule.stage_to_rank(self.schedule.num_stages - 1))
        with self._gathering():
            stats = self.cast.run(lambda: self._run(io, trace, measure))
        for reducer in self.reducers.values():
            reducer.finish()
        if self.ctx.tp_size > 1:  # on the reduced elements (shards under ZeRO)
            sum_over_tp(self._grad_pieces(is_tp_partial), self.ctx)
        self.ties.sync_grads(lambda p: self._grad_pieces(lambda q: q is p))
        self.last_stats = stats
        return self._global_loss(stats.loss_sum if stats.shared_loss is None else stats.shared_loss, stats.aux_sum)

    def _my_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """This CP rank's two chunks of every row (plait.context_parallel.layout); x itself without CP."""
        return shard_sequence(x, self.ctx.cp_size, self.ctx.cp_rank)

    def _run(self, io: StepIO, trace: bool, measure: bool) -> StepStats:
        """The executor's step, under the saved-tensor meter if ``measure``."""
        if not measure:
            return self.executor.run(io, trace=trace)
        weights = [*self._params, *self.cast.copies.values()]
        weights += [b for c in self.chunks.values() for b in c.buffers()]
        gathered = self.zero3.gathered_ptrs if self.zero3 is not None else None  # ZeRO-3's gathered weights
        meter = memory.SavedTensorMeter(exclude=weights, live_weights=gathered)
        devices.reset_peak_memory(self.ctx.device)
        with meter.hooks():
            stats = self.executor.run(io, trace=trace)
        self.activations_peak, self.device_peak = meter.peak, devices.peak_allocated(self.ctx.device)
        return stats

    def trace_report(self, p2p_ms: float = 0.0) -> TraceReport:
        """Measured vs simulated timeline of the last ``train_step(..., trace=True)`` (collective over PP)."""
        from plait.pipeline.trace import trace_report

        return trace_report(self, p2p_ms)

    def _holds_loss(self) -> bool:
        return self.schedule.stage_to_rank(self.schedule.num_stages - 1) == self.ctx.pp_rank

    def _loss_by_p2p(self) -> bool:
        """One pipeline and no auxiliary loss: the last stage's loss is the global loss (every TP rank of it
        holds the same value), sent to the other stages point to point."""
        return self.ctx.pp_size > 1 and self.ctx.dp_size == 1 and self.ctx.cp_size == 1 and not self.has_aux

    def _global_loss(self, local: torch.Tensor, aux: torch.Tensor) -> float:
        """Loss (+ auxiliary loss: ``last_aux_loss``; routing counts: ``last_expert_load``) summed over the world."""
        ctx = self.ctx
        if self._loss_by_p2p():  # ``local`` is the loss the last stage sent
            self.last_aux_loss = 0.0
            return float(local)
        alone = ctx.pp_size == ctx.dp_size == ctx.cp_size == 1 and (not self.has_aux or ctx.world_size == 1)
        mine = local if alone or self._holds_loss() and ctx.tp_rank == 0 else torch.zeros_like(local)
        total = torch.cat([torch.stack([mine, aux.to(local)]), self.routing.counts.to(local).flatten()])
        if not alone:  # loss: last-stage, tp-rank-0 (every CP rank's) parts; aux and routing: every rank's parts
            collective("all-reduce of the step's loss", None, lambda: dist.all_reduce(total))
        loss, self.last_aux_loss, *counts = total.tolist()  # one host read (it waits for the device's step)
        self.last_expert_load = self.routing.load(counts, self.last_aux_loss) if self.routing.n_layers else None
        return loss + self.last_aux_loss

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor) -> torch.Tensor:
        """The full model output (e.g. logits [B, S, V]) on every rank (forward-only pipeline)."""
        self._check_batch(inputs, None)
        io = StepIO(self._split(self._my_tokens(inputs)), None, None, select=self.documents.start(inputs))
        with self._gathering():
            stats = self.cast.run(lambda: self.executor.run(io, forward_only=True))
        out = torch.cat(stats.outputs) if stats.outputs else None
        if out is not None and self.vocab_size is not None:
            out = full_logits(out, self.ctx, self.vocab_size)
        if out is not None:  # whole rows again, in position order
            out = gather_sequence(out, self.ctx.cp_group, self.ctx.cp_size)
        return self._broadcast_from_last(out)

    def _broadcast_from_last(self, out: torch.Tensor | None) -> torch.Tensor:
        if self.ctx.pp_size == 1:
            assert out is not None, "the only pipeline rank holds the last chunk"
            return out
        src, group = self.ctx.pp_peer(self.schedule.stage_to_rank(self.schedule.num_stages - 1)), self.ctx.pp_group
        box: list[tuple[tuple[int, ...], torch.dtype] | None] = [None if out is None else (tuple(out.shape), out.dtype)]
        collective("pp broadcast of logit shape", group, lambda: dist.broadcast_object_list(box, src=src, group=group))
        assert box[0] is not None
        shape, dtype = box[0]
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=self.ctx.device)
        collective("pp broadcast of the logits", group, lambda: dist.broadcast(out, src=src, group=group))
        return out

    # ---------------------------------------------------------------------------------- state dicts
    def _local_full(self, grads: bool) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for chunk in self.chunks.values():
            for key, tensor in chunk.named_state().items():
                local = tensor.grad if grads else tensor
                local = torch.zeros_like(tensor) if local is None else local
                module, name = chunk.owner(key)
                full = module.full_tensor(name, local) if isinstance(module, TPShardedModule) else local.detach()
                out[key] = full.detach().clone().cpu()
        return out

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors (or gradients) under the plain model's keys, on every rank (collective)."""
        if grads and self.zero3 is None:  # ZeRO-1/2 keep a shard of each reduced gradient only: refused
            refuse_sharded_grads(self.reducers.values(), self.ctx)
        with nullcontext() if self.zero3 is None else self.zero3.full_state(grads):  # whole from the shards
            local = self._local_full(grads)
        return gather_full_state(local, self.ctx, self.plain_keys)  # EP: other experts, PP: other layers

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full tensors (plain-model keys, shapes as ``full_state_dict``'s); each rank keeps its own shards.
        No collective; a key missing or unknown, or a tensor of another shape, is a ConfigError before anything
        is written (as torch's strict ``load_state_dict``)."""
        check_full_state(state_dict, self.plain_keys, self.full_shapes)  # every rank: every stage's (experts: its EP's)
        exact: dict[nn.Parameter, torch.Tensor] = {}  # full-precision local values, for fp32 masters
        with self.full_parameters(gather=False, write_back=True):
            for chunk in self.chunks.values():
                for key, tensor in chunk.named_state().items():
                    module, name = chunk.owner(key)
                    full = state_dict[key].to(tensor.device)
                    local = module.shard_of(name, full) if isinstance(module, TPShardedModule) else full
                    tensor.copy_(local)
                    if isinstance(tensor, nn.Parameter):
                        exact[tensor] = local
        if self._optimizer is not None and hasattr(self._optimizer, "load_master_weights"):
            self._optimizer.load_master_weights(exact)  # a ZeRO optimizer's fp32 masters follow
