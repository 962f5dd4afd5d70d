"""The pipeline executor: runs one rank's actions of a ``Schedule`` in order — the same object the simulator
times. There is no per-schedule loop: F, B, I and W are the only things it knows.

F(c, mb)  receive the input (previous chunk's output, or the micro-batch), run chunk c, send the output
          (or compute the loss on the last chunk)
B(c, mb)  receive the output gradient, backward through chunk c, send the input gradient
I(c, mb)  as B, with linear weight gradients deferred (plait.weight_grad)
W(c, mb)  run the deferred weight-gradient work of (c, mb)
A micro-batch's saved state lives from its F to its B (or W), so the number held is what the simulator
counts as ``peak_activations``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.devices import synchronize
from plait.errors import CommError, CommTimeoutError
from plait.pipeline.p2p import ACT, GRAD, Transport
from plait.pipeline.step_plan import StepPlan, build_step_plan
from plait.schedules import Action, Schedule
from plait.weight_grad import WeightGradStore

if TYPE_CHECKING:
    from plait.data_parallel.reducer import GradReducer


@dataclass
class StepStats:
    """What one executed step measured on this rank."""

    loss_sum: torch.Tensor  # float64 scalar on the step's device
    aux_sum: torch.Tensor  # float64 scalar on the step's device
    peak_stored: float  # micro-batches of a whole stage (a chunk counts 1/V)
    peak_sends: int = 0  # send buffers alive at once (released as soon as the peer is known to have them)
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    shared_loss: torch.Tensor | None = None  # the loss another stage sent (StepIO.loss_from)
    started_at: float = 0.0  # time.perf_counter() the timeline's times count from (one clock for a host's ranks)
    ended_at: float = 0.0  # time.perf_counter() when this rank's forward/backward part ended


@dataclass
class StepIO:
    inputs: list[torch.Tensor]
    targets: list[torch.Tensor] | None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    # auxiliary loss a chunk's last forward produced (e.g. MoE load balancing), already scaled; it is
    # added to the loss on the last chunk and backpropagated together with the output on the others
    aux_fn: Callable[[torch.nn.Module], torch.Tensor | None] | None = None
    # sharing the step's loss point to point: the holder sends its loss sum to these global ranks as soon as
    # its last forward of the last chunk is done; a rank with ``loss_from`` set receives it from that rank
    loss_to: list[int] = field(default_factory=list)
    loss_from: int | None = None
    # called with a micro-batch's index before each forward and backward of it, and with None at the step's end
    # (plait.documents: the documents attention keeps to, on every stage and in a block recomputed during its
    # backward; none after the step, for a decoding that runs the same modules)
    select: Callable[[int | None], None] | None = None


class Executor:
    """Executes ``schedule.actions[pp_rank]`` over ``chunks`` (this rank's chunks by global index)."""

    def __init__(self, schedule: Schedule, pp_rank: int, peer_of_rank: Callable[[int], int],
                 chunks: Mapping[int, nn.Module], transport: Transport, store: WeightGradStore | None,
                 reducers: Mapping[int, GradReducer]):
        self.s, self.me, self.chunks = schedule, pp_rank, chunks
        self.transport, self.store = transport, store
        self.reducers = reducers  # chunk -> GradReducer (data parallel), started when the chunk is done
        self.last_chunk = schedule.num_stages - 1
        self.final_index = final_backward_index(schedule.actions[pp_rank])
        last_forwards = [i for i, a in enumerate(schedule.actions[pp_rank])
                         if a.kind == "F" and a.stage == self.last_chunk]
        self.loss_index = last_forwards[-1] if last_forwards else -1
        self.plans = {mode: build_step_plan(schedule, pp_rank, peer_of_rank, forward_only=mode)
                      for mode in (False, True)}

    def _post(self, plan: StepPlan, j: int) -> bool:
        recv = plan.recv[j]
        assert recv is not None, "only remote inputs are posted"
        kind, src, _, _ = recv
        a = plan.actions[j]
        return self.transport.post(src, kind, a.stage, a.microbatch)

    def run(self, io: StepIO, forward_only: bool = False, trace: bool = False) -> StepStats:
        plan = self.plans[forward_only]
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self.local: dict[tuple[int, int, int], torch.Tensor] = {}
        self.unposted: list[int] = []  # receives whose shape was not known yet when their turn came
        zero = torch.zeros((), dtype=torch.float64, device=self.transport.device)  # sums on the device: no host read
        stats = StepStats(loss_sum=zero, aux_sum=zero.clone(), peak_stored=0.0)
        try:
            if io.loss_from is not None and not forward_only:
                self.transport.post_loss(io.loss_from)
        except CommError as exc:
            raise type(exc)(f"pipeline rank {self.me}, start of step: {exc}") from exc
        t0 = stats.started_at = time.perf_counter()
        for i, a in enumerate(plan.actions):
            try:
                self._step(i, a, plan, io, stats, forward_only, trace, t0)
            except CommError as exc:
                raise type(exc)(self._explain(a, i, plan.recv[i], exc)) from exc
        if io.select is not None:
            io.select(None)
        try:
            self.transport.wait_sends()
            if io.loss_from is not None and not forward_only:
                stats.shared_loss = self.transport.wait_loss()
        except CommError as exc:
            raise type(exc)(f"pipeline rank {self.me}, end of step: {exc}") from exc
        stats.ended_at = time.perf_counter()
        return stats

    def _step(self, i: int, a: Action, plan: StepPlan, io: StepIO, stats: StepStats,
              forward_only: bool, trace: bool, t0: float) -> None:
        if self.unposted:  # only in a step that negotiates shapes (the first, or a new input shape)
            self.unposted = [j for j in self.unposted if j > i and not self._post(plan, j)]
        for j in plan.posts[i]:
            if not self._post(plan, j):
                self.unposted.append(j)
        data = self._receive(a, plan.recv[i], io)
        if trace:  # on a GPU an action's kernels run after their launch: time the work, not the launch
            synchronize(self.transport.device)
        start = time.perf_counter() - t0 if trace else 0.0
        final = not forward_only and self.final_index.get(a.stage) == i
        if final and a.kind == "B":
            self.reducers[a.stage].arm()  # buckets start as their gradients complete
        if io.select is not None and a.kind != "W":
            io.select(a.microbatch)
        if a.kind == "F":
            assert data is not None, "a forward always has an input"
            self._forward(a, data, io, stats, forward_only, plan.send[i])
            if i == self.loss_index and io.loss_to and not forward_only:
                self.transport.send_loss(stats.loss_sum, io.loss_to)
            # measured: micro-batches whose autograd state this rank holds right now
            stats.peak_stored = max(stats.peak_stored, len(self.saved) / self.s.virtual)
        elif a.kind == "W":
            assert self.store is not None, "W actions need a weight-gradient store"
            self.store.flush((a.stage, a.microbatch))
            del self.saved[(a.stage, a.microbatch)]
        else:
            self._backward(a, data, plan.send[i])
        if final:
            self.reducers[a.stage].launch_pending()
        stats.peak_sends = max(stats.peak_sends, len(self.transport.sends))
        if trace:
            synchronize(self.transport.device)
            stats.timeline.append((a, start, time.perf_counter() - t0))

    def _receive(self, a: Action, remote, io: StepIO) -> torch.Tensor | None:
        if a.kind == "W":
            return None
        if remote is not None:
            kind, src, _, producer = remote
            data = self.transport.recv(src, kind, a.stage, a.microbatch)
            self.transport.release(src, producer)  # what src consumed before producing this has arrived
            return data
        if a.kind == "F":
            return io.inputs[a.microbatch] if a.stage == 0 else self.local.pop((ACT, a.stage, a.microbatch))
        if a.stage == self.last_chunk:
            return None  # the backward of the last chunk starts from the loss
        return self.local.pop((GRAD, a.stage, a.microbatch))

    def _forward(self, a: Action, x: torch.Tensor, io: StepIO, stats: StepStats, forward_only: bool,
                 send) -> None:
        c, mb = a.stage, a.microbatch
        if c > 0 and not forward_only:
            x = x.detach().requires_grad_(x.is_floating_point())
        with torch.set_grad_enabled(not forward_only):
            out = self.chunks[c](x)
            aux = io.aux_fn(self.chunks[c]) if io.aux_fn is not None else None
            if aux is not None:
                stats.aux_sum += aux.detach().double()
            if c == self.last_chunk:
                if forward_only:
                    stats.outputs.append(out)
                    return
                assert io.loss_fn is not None and io.targets is not None, "training needs a loss and targets"
                out = io.loss_fn(out, io.targets[mb])
                stats.loss_sum += out.detach().double()
                if aux is not None:
                    out, aux = out + aux, None
        if send is not None:
            if not self.transport.known_shape(GRAD, c):  # the gradient coming back has the output's shape
                self.transport.set_shape(GRAD, c, out.shape, out.dtype)
            self._send(send, mb, out)
        if not forward_only:
            self.saved[(c, mb)] = (x, out, aux if aux is not None and aux.requires_grad else None)

    def _backward(self, a: Action, grad_out: torch.Tensor | None, send) -> None:
        """Run B (releases the saved state) or I (keeps it for the W pass)."""
        c, mb = a.stage, a.microbatch
        x, out, aux = self.saved[(c, mb)]
        outs, grads = ([out], [grad_out]) if aux is None else ([out, aux], [grad_out, torch.ones_like(aux)])
        if a.kind == "I":
            assert self.store is not None, "I actions need a weight-gradient store"
            with self.store.deferring((c, mb)):
                torch.autograd.backward(outs, grads)
        else:
            torch.autograd.backward(outs, grads)
            del self.saved[(c, mb)]
        if send is not None:
            assert x.grad is not None, "the input of a later chunk requires its gradient"
            self._send(send, mb, x.grad)

    def _send(self, send: tuple[int, int, int, int], mb: int, tensor: torch.Tensor) -> None:
        kind, chunk, dst, consumer = send
        if dst < 0:
            self.local[(kind, chunk, mb)] = tensor.detach()
        else:
            self.transport.send(tensor, dst, kind, chunk, mb, consumer)

    def _explain(self, a: Action, i: int, remote, exc: CommError) -> str:
        if exc.collective is not None:  # a collective inside the action (TP, EP, CP) names whom it lost itself
            return str(exc) if self.s.num_ranks == 1 else f"pipeline rank {self.me}, action {a} (#{i}): {exc}"
        state = "stuck" if isinstance(exc, CommTimeoutError) else "failed"
        if remote:
            what = "activation" if remote[0] == ACT else "gradient"
            needs = f"it needs the {what} from global rank {remote[1]} (chunk {remote[2]})"
        else:
            needs = "its input is local"
        return (f"pipeline rank {self.me} {state} in action {a} (#{i}); {needs}.\n{exc}\n"
                f"Schedule around it:\n{self.s.grid(marks={self.me: i}, window=12)}")


def final_backward_index(actions: list[Action]) -> dict[int, int]:
    """Chunk -> index of its last backward-type action (B or W) in this rank's list."""
    last: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.kind in ("B", "W"):
            last[a.stage] = i
    return last
