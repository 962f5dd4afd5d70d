"""A pipeline of real decoder layers timed as a run hands work along it, beside the same work without hand-offs.

``plait.sim.shared`` lets ranks that outnumber the cores share them at the speed real layers share them with
(``plan.host.compute.in_step``). A pipeline's ranks also hand work to each other: a rank blocks in its receive,
and the send that wakes it comes while every core is busy, so the woken rank takes a core from one that was
running. On four processes of two cores, two-stage 1F1B pipelines of a decoder layer (two replicas) took
1.08-1.11 times the same layers' work done without hand-offs, every process at once, where the simulator,
saturated, gives the two the same time. Two parts are timed, in alternating rounds so that the host's drift
touches both alike:

* the pipeline: ranks 2i and 2i+1 are stages 0 and 1 of replica i, each with one calibration layer
  (``plan.shapes.CALIBRATION_BLOCKS[-1]``), running 1F1B (``plait.schedules``) over ``MICROBATCHES``
  (``plan.shapes.PIPELINE_CALIBRATION_MICROBATCHES``) micro-batches; activations and gradients go point to
  point (a send is posted and waited at the step's end, a receive blocks, as a run's next action waits for
  its input);
* its twin: every rank runs its layer's forward and backward ``MICROBATCHES`` times, no hand-off.

Both are the section's span (the slowest rank's). ``plan.estimate.handoff`` finds the slow-down that makes
``plait.sim.shared`` give the pipeline the measured ratio of the two.
"""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.distributed as dist

from plait.distributed.collectives import collective
from plait.plan.host import shapes

MICROBATCHES = shapes.PIPELINE_CALIBRATION_MICROBATCHES
BUDGET_S = 2.0  # alternating rounds of the pipeline and its twin (about 0.5 s a round on 4 processes of 2 cores)
MIN_ROUNDS, MAX_ROUNDS = 2, 12


def oversubscribed(processes: int, threads: int, cores: int) -> bool:
    """Whether ``processes`` of ``threads`` threads outnumber ``cores`` (only then can a hand-off wait for a
    core) and pair up into two-stage pipelines."""
    return processes % 2 == 0 and processes * threads > cores


def _posted(work):
    """A send's work (torch types ``isend`` as possibly None: it is None only for a rank outside the group)."""
    assert work is not None
    return work


def _parts(device: torch.device):
    """(pipeline step, twin step) closures of this rank (stage ``rank % 2`` of replica ``rank // 2``)."""
    from plait.calibrate.kernels import decoder_layer
    from plait.devices import synchronize
    from plait.schedules import build_schedule

    layer, x = decoder_layer(shapes.CALIBRATION_BLOCKS[-1], device, torch.float32)
    x = x.detach()  # [B, S, h]
    rank = dist.get_rank()
    stage, peer = rank % 2, rank ^ 1
    actions = build_schedule("1f1b", stages=2, microbatches=MICROBATCHES).actions[stage]

    def pipeline() -> None:
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        sends: list = []  # the posted sends' works
        for a in actions:
            if a.kind == "F":
                inp = x
                if stage == 1:
                    inp = torch.empty_like(x)
                    dist.recv(inp, peer)
                inp = inp.detach().requires_grad_(stage == 1)
                out = layer(inp)
                held[a.microbatch] = (inp, out)
                if stage == 0:
                    sends.append(_posted(dist.isend(out.detach(), peer)))
            else:
                inp, out = held.pop(a.microbatch)
                grad = torch.ones_like(out)
                if stage == 0:
                    dist.recv(grad, peer)
                out.backward(grad)
                if stage == 1:
                    assert inp.grad is not None
                    sends.append(_posted(dist.isend(inp.grad, peer)))
        for work in sends:
            work.wait()
        synchronize(device)

    def twin() -> None:
        for _ in range(MICROBATCHES):
            inp = x.detach().requires_grad_(stage == 1)  # as in the pipeline: stage 0's input needs no gradient
            layer(inp).backward(torch.ones_like(inp))
        synchronize(device)

    return pipeline, twin


def measure(processes: int, world_group, device: torch.device, budget: float = BUDGET_S) -> tuple[float, float]:
    """(seconds of a pipeline step, of its twin): the section's span over ranks ``[0, processes)``, averaged
    over about ``budget`` seconds of alternating rounds; collective over the whole world (ranks beyond
    ``processes`` only join the barriers)."""
    rank = dist.get_rank()
    parts = _parts(device) if rank < processes else None
    t0 = time.perf_counter()
    if parts is not None:
        for fn in parts:  # warm-up (and the pairs' connections)
            fn()
    elapsed = torch.tensor([time.perf_counter() - t0], device=device)
    collective("calibration's all-reduce of the pipeline's warm-up time", world_group,  # the same rounds everywhere
               lambda: dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=world_group))
    rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, int(budget / max(float(elapsed[0]), 1e-6))))
    spent = torch.zeros(2, dtype=torch.float64, device=device)
    for _ in range(rounds):
        for i in range(2):
            collective("calibration's barrier before a timed pipeline", world_group,  # the section starts together
                       lambda: dist.barrier(group=world_group))
            t0 = time.perf_counter()
            if parts is not None:
                parts[i]()
            span = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
            collective("calibration's all-reduce of a timed pipeline's span", world_group,
                       partial(dist.all_reduce, span, op=dist.ReduceOp.MAX, group=world_group))
            spent[i] += span[0]
    return float(spent[0]) / rounds, float(spent[1]) / rounds
