"""The sleep workload of bench/pipeline.py and its floor: a minimal loop that runs a schedule's actions.

``SleepLayer``: forward sleeps t, backward sleeps t (input gradient) + t (weight gradient, deferrable to
a W pass through plait's WeightGradStore or torch's ``dw_builder``). Sleeping keeps 2 cores free for 4
ranks, so what is measured is the runtime's own work and the transport.

``MinimalLoop`` is the floor: the same per-rank action list run with nothing but a blocking receive,
the chunk, ``torch.autograd.backward`` and an ``isend`` per action — the hand-written 1F1B loop of any
tutorial, driven by the list so it also runs GPipe and interleaved orders. No shape negotiation,
timeouts, buffer release, data parallelism or tracing.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from plait.schedules import Schedule

WIDTH = 16  # features of the tiny activations; rows = 2 per micro-batch


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, t, store):
        ctx.save_for_backward(x)
        ctx.t, ctx.store, ctx.w = t, store, w
        time.sleep(t)
        return x * w

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        time.sleep(ctx.t)  # input gradient

        def weight_grad(w=ctx.w, g=g, x=x, t=ctx.t):
            time.sleep(t)
            w.grad = (g * x).sum() if w.grad is None else w.grad + (g * x).sum()

        if ctx.store is None or ctx.store.key is None:
            weight_grad()
        else:
            ctx.store.defer_or_run(weight_grad)
        return g * ctx.w.detach(), None, None, None


class SleepLayer(nn.Module):
    """Forward sleeps t, backward sleeps t (input grad) + t (weight grad, deferrable)."""

    wgrad_store = None  # set by plait's runtime (zero-bubble schedules) or by the torch harness

    def __init__(self, t: float):
        super().__init__()
        self.t = t
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _Sleep.apply(x, self.w, self.t, self.wgrad_store)


def mse(out, y):
    return ((out - y) ** 2).mean()


def measure_chunk(chunk: nn.Module, store=None, repeats: int = 5) -> tuple[float, float, float]:
    """(forward, backward, weight) ms of one micro-batch through ``chunk`` timed alone, outside any runtime.

    With a WeightGradStore the backward is split: ``backward`` is I + W, ``weight`` the W pass alone.
    """
    fwd, bwd, wgt = [], [], []
    for _ in range(repeats):
        x = torch.ones(2, WIDTH, requires_grad=True)
        t0 = time.perf_counter()
        out = chunk(x)
        t1 = time.perf_counter()
        if store is None:
            out.backward(torch.ones_like(out))
            t3 = t2 = time.perf_counter()
        else:
            with store.deferring((0, 0)):
                out.backward(torch.ones_like(out))
            t2 = time.perf_counter()
            store.flush((0, 0))
            t3 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t3 - t1)
        wgt.append(t3 - t2)
    chunk.zero_grad(set_to_none=True)
    return tuple(1000.0 * statistics.median(v) for v in (fwd, bwd, wgt))


class MinimalLoop:
    """Runs ``schedule.actions[rank]`` (F and B only) with the least a pipeline needs."""

    def __init__(self, schedule: Schedule, rank: int, chunks: dict[int, nn.Module]):
        if any(a.kind not in "FB" for row in schedule.actions for a in row):
            raise ValueError("the floor runs F/B schedules only")
        self.s, self.me, self.chunks = schedule, rank, chunks
        self.last = schedule.num_stages - 1

    def _tag(self, kind: int, chunk: int, mb: int) -> int:
        return (kind * self.s.num_stages + chunk) * self.s.microbatches + mb + 1

    def _get(self, local: dict, key: tuple[int, int, int], src_chunk: int) -> torch.Tensor:
        src = self.s.placement[src_chunk]
        if src == self.me:
            return local.pop(key)
        buf = torch.empty(2, WIDTH)
        dist.recv(buf, src, tag=self._tag(*key))
        return buf

    def _put(self, local: dict, key: tuple[int, int, int], dst_chunk: int, t: torch.Tensor, sends: list) -> None:
        dst = self.s.placement[dst_chunk]
        if dst == self.me:
            local[key] = t.detach()
        else:
            sends.append(dist.isend(t.detach().contiguous(), dst, tag=self._tag(*key)))

    def step(self, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
        saved, local, sends = {}, {}, []
        for kind, c, mb in self.s.actions[self.me]:
            if kind == "F":
                x = xs[mb] if c == 0 else self._get(local, (0, c, mb), c - 1).requires_grad_()
                out = self.chunks[c](x)
                if c == self.last:
                    out = mse(out, ys[mb])
                else:
                    self._put(local, (0, c + 1, mb), c + 1, out, sends)
                saved[(c, mb)] = (x, out)
            else:
                x, out = saved.pop((c, mb))
                grad = None if c == self.last else self._get(local, (1, c, mb), c + 1)
                torch.autograd.backward(out, grad)
                if c > 0:
                    self._put(local, (1, c - 1, mb), c - 1, x.grad, sends)
        for work in sends:
            work.wait()
