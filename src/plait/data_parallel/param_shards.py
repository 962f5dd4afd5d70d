"""ZeRO-3 parameter sharding: each data-parallel rank keeps 1/d of every parameter bucket, and a block's
parameters are all-gathered just before its forward, freed after it, and gathered again for its backward.

Rajbhandari et al. 2020, "ZeRO", §5.3 (P_os+g+p): the gradient buckets of ``data_parallel.reducer`` are cut one
per pipeline block (embedding, each layer, final norm, head) and reduction group; the same geometry holds the
parameters. Member r of a bucket's group keeps ``shard`` = elements ``[r·padded/d, (r+1)·padded/d)`` of the
bucket's flat parameters in float32: these are the optimizer's master weights (plait.optim.masters) and its
moments cover the same elements; each shard is an ``nn.Parameter`` whose ``.grad`` is the reduced gradient
shard after a step (``point_grads``), so a plain torch optimizer can step it too, as over FSDP2's sharded
parameters. The block's ``nn.Parameter`` objects stay (ties, TP marks and gradient groups
refer to them) as views of one flat ``[padded]`` buffer per bucket in the compute dtype (bf16 weights are
gathered as bf16), whose storage is resized to zero between uses, as torch's FSDP does; autograd's saved
references to a weight see it again once it is gathered for the backward.

Per block i of the chunk, hooks on the block module:
- forward:  wait for i's gather (issue it if not in flight), issue i+1's (prefetch), run, free i;
- backward: a hook on i's output fires when its gradient is known, before i's backward runs: wait for i's
  gather and free i+1 (its backward is done). i's first parameter gradient issues i-1's gather (the reducer has
  just waited for i+1's reduction then, so one collective's buffers are in flight at a time; a block without
  gradients of its own issues it at once). i's gradients are reduce-scattered by the reducer (``zero3_reducer``)
  as soon as they are complete, and a bucket's gathered parameters are freed just before its reduction starts
  (every gradient that reads them has been computed).
A chunk's last block is kept after a forward where the rank's next action is that chunk's backward (1f1b's
steady phase, a pipeline's last stage, no pipeline: the backward starts with it); after any other forward it is freed
as the others are (1f1b's warm-up, gpipe's forwards, most of an interleaved schedule's), so nothing stays gathered
while other forwards run: the working set is the largest pair of neighbouring blocks of one chunk, and every block is
gathered twice per micro-batch but a kept last block once. A rank with several chunks (interleaved-1f1b, looped-bfs)
runs them over one set of blocks, the chunks' in order, prefetching inside a chunk only. A block called again
inside the backward (full recomputation's checkpoint) finds its parameters gathered. Blocks called outside the
chunk's forward (decoding) gather and free around each call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from plait.data_parallel.reducer import Bucket, GradReducer
from plait.data_parallel.zero3_reducer import Zero3Reducer
from plait.distributed.collectives import all_gather_tensor, collective
from plait.errors import ConfigError
from plait.pipeline.partition import PipelineChunk

GATHER = "dp all-gather of sharded parameters"  # what a failed gather of a bucket's shards names


def gather_bucket(b: Bucket, local: torch.Tensor) -> torch.Tensor:
    """All-gather one ``[shard]`` tensor per member of bucket ``b``'s group into ``[padded]``."""
    if b.size == 1:
        return local
    full = torch.empty(b.padded, dtype=local.dtype, device=local.device)
    collective(GATHER, b.group, lambda: all_gather_tensor(full, local, group=b.group))
    return full


class ShardedBucket:
    """One bucket's parameters: this member's float32 ``shard`` and the gathered ``flat`` they view."""

    def __init__(self, b: Bucket, dtype: torch.dtype):
        self.b = b
        self.device = b.params[0].device
        full = torch.zeros(b.padded, dtype=torch.float32, device=self.device)  # [padded]
        with torch.no_grad():
            for p, off in zip(b.params, b.offsets, strict=True):
                full[off:off + p.numel()].copy_(p.detach().reshape(-1))
        # [shard] float32: the master weights of these elements, a parameter any torch optimizer steps in place
        self.shard = nn.Parameter(full[b.lo:b.hi].clone())
        del full
        self.holders: set[int] = set()  # blocks that need the gathered parameters now
        self.work = None
        self._src: torch.Tensor | None = None  # the gather's input, alive while it is in flight
        self.flat = self._point(dtype)

    def _point(self, dtype: torch.dtype) -> torch.Tensor:
        """A new flat buffer of ``dtype`` with its storage freed; the parameters become views of it."""
        flat = torch.empty(self.b.padded, dtype=dtype, device=self.device)
        for p, off in zip(self.b.params, self.b.offsets, strict=True):
            p.data = flat[off:off + p.numel()].view(p.shape)
        flat.untyped_storage().resize_(0)
        self.flat = flat
        return flat

    @property
    def live(self) -> bool:
        return self.flat.untyped_storage().nbytes() > 0

    @property
    def nbytes(self) -> int:
        return self.b.padded * self.flat.element_size()

    @torch.no_grad()
    def start(self) -> None:
        """Allocate the flat buffer and start gathering it (asynchronously over the bucket's group)."""
        if self.live:
            return
        self.flat.untyped_storage().resize_(self.nbytes)
        src = self.shard if self.shard.dtype == self.flat.dtype else self.shard.to(self.flat.dtype)
        if self.b.size == 1:
            self.flat.copy_(src)
            return
        self._src = src
        self.work = all_gather_tensor(self.flat, src, group=self.b.group, async_op=True)

    def wait(self) -> None:
        if self.work is not None:
            collective(GATHER, self.b.group, self.work.wait)
            self.work, self._src = None, None

    def free(self) -> None:
        self.wait()
        self.flat.untyped_storage().resize_(0)

    def set_dtype(self, dtype: torch.dtype) -> None:
        if dtype != self.flat.dtype:
            self.free()
            self._point(dtype)

    @torch.no_grad()
    def write_back(self) -> None:
        """The gathered (and possibly modified) values of this member's elements back into the shard."""
        self.shard.copy_(self.flat[self.b.lo:self.b.hi])


class ParamShards:
    """The ZeRO-3 parameters of one rank's pipeline chunks (their ``blocks`` in chunk order), over the buckets of
    its reducer."""

    def __init__(self, chunks: Sequence[PipelineChunk], reducer: Zero3Reducer, dtype: torch.dtype,
                 keeps: Sequence[Sequence[bool]]):
        """``keeps[j]``: for each forward of ``chunks[j]`` in a step, in order, whether the rank's next action is
        that chunk's backward (its last block is then kept)."""
        frozen = [n for chunk in chunks for n, p in chunk.named_parameters() if not p.requires_grad]
        if frozen:
            raise ConfigError(f"zero=3 shards trainable parameters; {frozen[0]} does not require a gradient: "
                              "make it a buffer, or use zero=2")
        self.sharded = {id(b): ShardedBucket(b, dtype) for b in reducer.buckets}
        self.blocks: list[nn.Module] = [block for chunk in chunks for block in chunk.blocks]
        # per block, the indices [start, end) of its chunk's blocks: prefetches and the kept block stay in a chunk
        self.start: list[int] = []
        self.end: list[int] = []
        for chunk in chunks:
            n, at = len(chunk.blocks), len(self.start)
            self.start += [at] * n
            self.end += [at + n] * n
        self.needs: list[list[ShardedBucket]] = []
        for block in self.blocks:
            seen: dict[int, ShardedBucket] = {}
            for p in block.parameters():
                s = self.sharded[id(reducer.bucket_of(p))]
                seen.setdefault(id(s), s)
            self.needs.append(list(seen.values()))
        self.in_chunk = False  # inside the chunk's own forward (not a recomputation, not decoding)
        self.backward: set[int] = set()  # blocks whose backward has started and that still hold parameters
        self.live_bytes = self.peak_bytes = 0
        self.ptrs: set[int] = set()  # storage addresses of the gathered buffers (not activations: memory.py)
        self.owner = {id(b): i for i, unit in enumerate(block_units(chunks)) for p in unit
                      for b in [reducer.bucket_of(p)]}  # bucket -> the block whose gradients fill it
        self.reducer = reducer
        reducer.before_launch, reducer.on_first_grad, reducer.on_finish = self._drop, self._first_grad, self.point_grads
        self.keeps = [list(k) for k in keeps]
        self.forwards = [0] * len(chunks)  # of each chunk in this step
        self.keep_last = False  # the running forward's chunk keeps its last block
        for j, chunk in enumerate(chunks):
            chunk.register_forward_pre_hook(lambda m, args, j=j: self._chunk_pre(j))
            chunk.register_forward_hook(self._chunk_post)
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(lambda m, args, i=i: self._pre(i))
            block.register_forward_hook(lambda m, args, out, i=i: self._post(i, out))

    # ------------------------------------------------------------------------------- holding
    def _acquire(self, i: int) -> None:
        for s in self.needs[i]:
            s.holders.add(i)
            if not s.live:
                s.start()
                self.live_bytes += s.nbytes
                self.ptrs.add(s.flat.untyped_storage().data_ptr())
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _ensure(self, i: int) -> None:
        self._acquire(i)
        for s in self.needs[i]:
            s.wait()

    def _release(self, i: int) -> None:
        for s in self.needs[i]:
            s.holders.discard(i)
            if not s.holders:
                self._free(s)

    def _drop(self, b: Bucket) -> None:
        """Bucket ``b``'s gradients are complete: its gathered parameters are freed, whichever blocks hold them."""
        s = self.sharded[id(b)]
        s.holders.clear()
        self._free(s)

    def _free(self, s: ShardedBucket) -> None:
        if s.live:
            self.ptrs.discard(s.flat.untyped_storage().data_ptr())
            s.free()
            self.live_bytes -= s.nbytes

    def _release_backward(self) -> None:
        for i in sorted(self.backward):
            self._release(i)
        self.backward.clear()

    @contextmanager
    def step(self) -> Iterator[None]:
        """One step's forward and backward: its gathered peak is measured, what is still gathered is freed."""
        self.peak_bytes = self.live_bytes
        self.forwards = [0] * len(self.forwards)
        try:
            yield
        finally:
            self.release_all()

    def release_all(self) -> None:
        """Free every gathered parameter (the end of a step)."""
        self._release_backward()
        for i in range(len(self.blocks)):
            self._release(i)

    # ---------------------------------------------------------------------------------- hooks
    def _chunk_pre(self, j: int) -> None:
        self._release_backward()  # a new micro-batch or chunk: the previous backward is over
        k, self.forwards[j] = self.forwards[j], self.forwards[j] + 1
        self.keep_last = k < len(self.keeps[j]) and self.keeps[j][k]
        self.reducer.settle_in_flight()  # its last reduction is not carried through this forward
        self.in_chunk = True

    def _chunk_post(self, module, args, out) -> None:
        self.in_chunk = False

    def _pre(self, i: int) -> None:
        self._ensure(i)
        if self.in_chunk and i + 1 < self.end[i]:
            self._acquire(i + 1)  # prefetch: its gather runs while block i computes

    def _post(self, i: int, out) -> None:
        if i in self.backward:
            return  # recomputed inside the backward: the backward needs the parameters next
        grad_out = out if torch.is_tensor(out) else next((t for t in out if torch.is_tensor(t)), None)
        if self.in_chunk and grad_out is not None and grad_out.requires_grad:  # training: backward to come
            grad_out.register_hook(lambda g, i=i: self._on_grad(i))
            if i == self.end[i] - 1 and self.keep_last:
                return  # the chunk's last block, and its backward (which starts with it) comes next
        self._release(i)

    def _on_grad(self, i: int) -> None:
        """Block i's backward is about to run (its output gradient is known); block i+1's is done."""
        if i + 1 < self.end[i] and i + 1 in self.backward:
            self.backward.discard(i + 1)
            self._release(i + 1)
        self.backward.add(i)
        self._ensure(i)
        if i > self.start[i] and not any(self.owner.get(id(s.b)) == i for s in self.needs[i]):
            self._acquire(i - 1)  # no gradient of its own will come to issue the prefetch

    def _first_grad(self, b: Bucket) -> None:
        """The first gradient of bucket ``b`` in this backward: prefetch the block before its block."""
        i = self.owner[id(b)]
        if i > self.start[i] and i in self.backward:
            self._acquire(i - 1)

    # ---------------------------------------------------------------------------- whole model
    def set_dtype(self, dtype: torch.dtype) -> None:
        """Gather the parameters in ``dtype`` from now on (the compute precision)."""
        self.release_all()
        for s in self.sharded.values():
            s.set_dtype(dtype)

    @contextmanager
    def full(self, gather: bool = True, write_back: bool = False) -> Iterator[None]:
        """Every parameter of the chunk whole, in float32, for the duration (checkpoints, state dicts).

        ``gather``: filled from the shards (collective over each bucket's group), else zeros to be written;
        ``write_back``: each member's elements go back into its shard afterwards (loading)."""
        self.release_all()
        dtypes = {id(s): s.flat.dtype for s in self.sharded.values()}
        for s in self.sharded.values():
            s.set_dtype(torch.float32)
            if gather:
                s.start()
            else:
                s.flat.untyped_storage().resize_(s.nbytes)
                s.flat.zero_()
        for s in self.sharded.values():
            s.wait()
        try:
            yield
        finally:
            for s in self.sharded.values():
                if write_back:
                    s.write_back()
                s.free()
                s.set_dtype(dtypes[id(s)])

    def shard_of(self, b: Bucket) -> torch.Tensor:
        """This member's float32 elements of bucket ``b``'s parameters: [shard]."""
        return self.sharded[id(b)].shard

    def shards(self) -> list[nn.Parameter]:
        """Every bucket's float32 shard (a parameter; ``point_grads`` gives it its reduced gradient)."""
        return [s.shard for s in self.sharded.values()]

    def point_grads(self) -> None:
        """At the end of a step's reduction: each shard's ``.grad`` is its bucket's reduced gradient shard (the same
        tensor, no copy; [shard], its padding zero), so an optimizer over ``shards()`` updates them in place and
        the next gather reads the new values."""
        for s in self.sharded.values():
            s.shard.grad = self.reducer.shard(s.b)

    def gathered_bytes(self) -> int:
        """Bytes of gathered parameters held right now (0 between steps)."""
        return sum(s.nbytes for s in self.sharded.values() if s.live)


def block_units(chunks: Sequence[PipelineChunk]) -> list[list[nn.Parameter]]:
    """The parameters of each block of ``chunks`` (in order), a parameter with the first block that uses it (tied
    ones)."""
    seen: set[int] = set()
    units = []
    for block in (block for chunk in chunks for block in chunk.blocks):
        unit = [p for p in block.parameters() if id(p) not in seen]
        seen.update(id(p) for p in unit)
        units.append(unit)
    return units


@contextmanager
def gathered_grads(shards: ParamShards | None, reducer: GradReducer) -> Iterator[None]:
    """Every parameter's ``.grad`` whole (float32) for the duration, from the reduced shards (collective);
    nothing without ``shards``."""
    if shards is None:
        yield
        return
    params = []
    with torch.no_grad():
        for s in shards.sharded.values():
            full = gather_bucket(s.b, reducer.shard(s.b))  # [padded]
            for p, off in zip(s.b.params, s.b.offsets, strict=True):
                p.grad = full[off:off + p.numel()].view(p.shape).to(p.dtype)
                params.append(p)
    try:
        yield
    finally:
        for p in params:
            p.grad = None
