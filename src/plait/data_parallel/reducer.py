"""Bucketed gradient reduction over the data-parallel group, overlapped with the remaining backward work.

Buckets are filled in reverse parameter order (roughly the order backward produces gradients). While
armed, a bucket whose every gradient has been accumulated launches an asynchronous all-reduce at once;
``finish()`` launches what is left, waits, and writes the reduced gradients back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from plait.distributed.context import ParallelContext


def set_grad_group(param: nn.Parameter, group, size: int) -> None:
    """Reduce ``param``'s gradient over ``group`` (of ``size`` ranks) instead of the DP group (e.g. experts)."""
    setattr(param, "_plait_grad_group", (group, size))  # noqa: B010 (read by GradReducer)


class _Bucket:
    def __init__(self, params: list[nn.Parameter], group, size: int):
        self.params, self.group, self.size = params, group, size
        self.ready: set[int] = set()
        self.work = None
        self.buffer: torch.Tensor | None = None

    def reset(self) -> None:
        self.ready.clear()
        self.work, self.buffer = None, None


class GradReducer:
    """Sums (``op="sum"``) or averages gradients of ``params`` over ``ctx``'s DP group in buckets."""

    def __init__(self, params: list[nn.Parameter], ctx: ParallelContext, *, bucket_mb: float = 25.0,
                 op: str = "sum"):
        self.ctx, self.op = ctx, op
        self.armed = False
        self.buckets: list[_Bucket] = []
        self._where: dict[int, _Bucket] = {}
        by_group: dict[int, tuple[object, int, list[nn.Parameter]]] = {}
        for p in params:  # most go over DP; set_grad_group redirects some (experts: expert-DP group)
            group, size = getattr(p, "_plait_grad_group", (ctx.dp_group, ctx.dp_size))
            if p.requires_grad and size > 1:
                by_group.setdefault(id(group), (group, size, []))[2].append(p)
        for group, size, members in by_group.values():
            self._fill(members, group, size, int(bucket_mb * 2**20))
        self.enabled = bool(self.buckets)
        for b in self.buckets:
            for p in b.params:
                self._where[id(p)] = b
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _fill(self, params: list[nn.Parameter], group, group_size: int, cap: int) -> None:
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                self.buckets.append(_Bucket(current, group, group_size))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current, group, group_size))

    def arm(self) -> None:
        """Reduce buckets as soon as they are complete during the next backward passes."""
        if self.enabled:
            self.armed = True
            for b in self.buckets:
                b.reset()

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        bucket = self._where[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params) and bucket.work is None:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        bucket.buffer = torch.cat([g.reshape(-1) for g in grads])
        if self.op == "avg":
            bucket.buffer.div_(bucket.size)
        bucket.work = dist.all_reduce(bucket.buffer, group=bucket.group, async_op=True)

    def launch_pending(self) -> None:
        """Start the reduction of every bucket not yet started (a missing gradient counts as zeros)."""
        if not self.enabled:
            return
        for b in self.buckets:
            if b.work is None:
                self._launch(b)
        self.armed = False

    def finish(self) -> None:
        """Launch what is left, wait for every bucket and write the reduced gradients back."""
        if not self.enabled:
            return
        self.launch_pending()
        for b in self.buckets:
            assert b.work is not None and b.buffer is not None, "launch_pending started every bucket"
            b.work.wait()
            offset = 0
            for p in b.params:
                n = p.numel()
                chunk = b.buffer[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = chunk.clone()
                else:
                    p.grad.copy_(chunk)
                offset += n
            b.reset()
        self.armed = False
