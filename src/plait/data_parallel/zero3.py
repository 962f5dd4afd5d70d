"""ZeRO-3 as a ``ParallelModel`` runs it: the per-block gradient reducer and the sharded parameters of this rank's
pipeline chunks (the whole model at pp = 1; its stage, or its several chunks under interleaved-1f1b and
looped-bfs), and what the model asks of them around a step, for state dicts and in its memory report."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import NoReturn

import torch

from plait.data_parallel.param_shards import ParamShards, block_units, gathered_grads
from plait.data_parallel.zero3_reducer import Zero3Reducer
from plait.distributed.context import ParallelContext
from plait.errors import ConfigError
from plait.optim.precision import PRECISIONS, StepCast
from plait.parallel_config import ZERO3_SCHEDULES
from plait.pipeline.partition import PipelineChunk
from plait.schedules import Schedule


class Zero3:
    """The ZeRO-3 of a rank's chunks: ``reducer`` (a bucket per block and reduction group, reduce-scattered as each
    block's gradients complete: ``zero3_reducer``) and ``shards`` (1/d of every bucket's parameters, gathered
    around each block's use: ``param_shards``), one of each over the blocks of every chunk. ``cast`` gathers in the
    compute dtype from now on (no per-step copy).

    Refuses (ConfigError) a schedule that splits backward passes (zero-bubble: weight passes after the input's)."""

    def __init__(self, chunks: Mapping[int, PipelineChunk], ctx: ParallelContext, cast: StepCast,
                 schedule: Schedule):
        if any(a.kind == "I" for r in schedule.actions for a in r):
            raise ConfigError(f"zero=3 runs without split backward passes; schedule {schedule.name!r} splits them: "
                              f"use {', '.join(ZERO3_SCHEDULES)}")
        order = sorted(chunks)
        self.reducer = Zero3Reducer(block_units([chunks[c] for c in order]), ctx)
        #: every chunk's reducer (the same one): the executor launches what is pending at each chunk's last backward
        self.reducers = dict.fromkeys(order, self.reducer)
        cast.set_gathered(cast.precision)
        row = schedule.actions[ctx.pp_rank]
        # per chunk, for each of its forwards: is the rank's next action this chunk's backward
        keeps = [[a is not None and a.stage == c and a.kind == "B" for f, a in zip(row, [*row[1:], None], strict=True)
                  if f.kind == "F" and f.stage == c] for c in order]
        self.shards = ParamShards([chunks[c] for c in order], self.reducer, cast.dtype or torch.float32, keeps)

    def set_precision(self, precision: str, cast: StepCast) -> None:
        """Gather in ``precision``'s dtype from now on; the shards stay float32."""
        cast.set_gathered(precision)
        self.shards.set_dtype(PRECISIONS[precision] or torch.float32)

    def step(self) -> AbstractContextManager:
        """A step's forward and backward: measures the gathered peak, frees what is left at the end."""
        return self.shards.step()

    def full(self, gather: bool = True, write_back: bool = False) -> AbstractContextManager:
        """Every parameter whole in float32 for the duration (``ParamShards.full``)."""
        return self.shards.full(gather=gather, write_back=write_back)

    @contextmanager
    def full_state(self, grads: bool) -> Iterator[None]:
        """Every parameter whole for the duration, and with ``grads`` their gradients too (from the reduced
        shards): a state dict's read (collective over each bucket's group)."""
        with self.full(), gathered_grads(self.shards if grads else None, self.reducer):
            yield

    def refuse_names(self) -> NoReturn:
        """A ConfigError for ``named_parameters()``: the tensors an optimizer steps (``held``) have no names."""
        raise ConfigError("named_parameters() under zero=3: an optimizer steps this rank's float32 bucket shards "
                          "(pm.parameters()), each holding slices of several parameters (matrices and norms together): "
                          "no parameter name fits one, and choices by name (weight-decay groups) would be silently "
                          "wrong. Pass pm.parameters() to a torch optimizer (one setting for every element) or use "
                          "ParallelOptimizer(pm, ..., zero=3) (weight-decay groups by name); "
                          "pm.named_model_parameters() names the model's own parameters (whole inside "
                          "pm.full_parameters())")

    def held(self) -> list[torch.nn.Parameter]:
        """The float32 shards this rank keeps between steps (parameters and masters at once)."""
        return self.shards.shards()

    @property
    def gathered_peak(self) -> int:
        """The most bytes of gathered parameters held at once during the last step."""
        return self.shards.peak_bytes

    @property
    def gathered_ptrs(self) -> set[int]:
        """Storage addresses of the gathered buffers (weights, not activations, for the saved-tensor meter)."""
        return self.shards.ptrs
