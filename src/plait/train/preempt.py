"""Preemption: SIGTERM (what SLURM and Kubernetes send before they kill a job), or Ctrl-C (SIGINT), stops
training at the next step boundary with a checkpoint. Every rank agrees on that step with one tiny all-reduce
per step, so no rank is left waiting in a collective that the others never join."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from plait.distributed.collectives import collective
from plait.distributed.job_signals import SignalThread

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Records a stop signal (taken in a ``SignalThread``, which only sets a flag); ``agreed`` tells every rank the
    same answer. The launcher's SIGTERM that ends a failed job also ends the rank soon, whatever it waits on."""

    def __init__(self):
        self.signum: int | None = None

    def install(self, signals: tuple[int, ...] = SIGNALS) -> StopRequest:
        """Catch ``signals`` in this process (main thread only; elsewhere they keep their default action)."""
        SignalThread(signals, self._note)
        return self

    def _note(self, signum: int, failed: bool) -> None:
        self.signum = signum

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    def agreed(self, ctx) -> bool:
        """Collective over the world: True on every rank if any rank has received a stop signal."""
        flag = torch.tensor([0.0 if self.signum is None else float(self.signum)], device=ctx.device)
        if ctx.world_size > 1:
            collective("all-reduce of stop signals", ctx.world_group,
                       lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.world_group))
        if flag.item() > 0 and self.signum is None:
            self.signum = int(flag.item())  # a peer's signal: stop for the same reason
        return flag.item() > 0
