"""ZeRO's master weights: the fp32 values of the parameter pieces a rank owns, and the all-gather that brings
every data-parallel replica the updated parameters (Megatron-LM's distributed optimizer). Under ZeRO-3 the
masters are views of the model's own float32 parameter shards (plait.data_parallel.param_shards), which every
forward gathers: no copy, no all-gather after the step.

With float32 parameters the masters are flat views of the parameters' owned pieces (updating them updates
the model). With bf16 compute the masters are float32 copies, one flat tensor per bucket shard, and the
model's parameters are then stored in bf16: 2 B per parameter on every rank, 4 B per owned element here.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.data_parallel.param_shards import gather_bucket
from plait.errors import ConfigError
from plait.optim.shards import ShardLayout


class Masters:
    """One float32 master ``nn.Parameter`` per owned piece (``params``, in ``layout.pieces`` order)."""

    def __init__(self, layout: ShardLayout, pm):
        self.layout = layout
        self.sharded = pm.param_shards is not None  # ZeRO-3: the parameters' own float32 shards are the masters
        self.separate = pm.precision != "fp32" and not self.sharded
        self.flats: list[torch.Tensor | None] = []  # per bucket: its owned elements, float32 (separate)
        self.params: list[nn.Parameter] = []
        if self.sharded:
            for (_, b), pieces in zip(layout.buckets, layout.by_bucket, strict=True):
                shard = pm.param_shards.shard_of(b)  # [shard]
                self.flats.append(None)
                self.params += [nn.Parameter(shard[pc.at:pc.at + pc.numel]) for pc in pieces]
            return
        for pieces in layout.by_bucket:
            for pc in pieces:
                if not pc.param.is_contiguous():
                    raise ConfigError(f"zero>0 needs contiguous parameters; {pc.name} is not")
            if not self.separate:
                self.flats.append(None)
                self.params += [nn.Parameter(pc.param.detach().view(-1)[pc.lo:pc.hi]) for pc in pieces]
                continue
            flat = torch.cat([pc.param.detach().reshape(-1)[pc.lo:pc.hi].float() for pc in pieces]) if pieces \
                else torch.zeros(0, device=pm.ctx.device)
            self.flats.append(flat)  # [owned of b]: the pieces are contiguous in the shard
            self.params += [nn.Parameter(flat[pc.at:pc.at + pc.numel]) for pc in pieces]
        if self.separate:
            pm.store_params(torch.bfloat16)

    def nbytes(self) -> int:
        """Bytes the masters add (0 when they are views of float32 parameters)."""
        return sum(f.numel() * f.element_size() for f in self.flats if f is not None)

    @torch.no_grad()
    def publish(self) -> None:
        """Write the updated masters into the parameters of every replica (one all-gather per bucket; nothing
        under ZeRO-3, whose next gather reads them)."""
        if self.sharded:
            return
        it = iter(self.params)
        for (_, b), pieces, flat in zip(self.layout.buckets, self.layout.by_bucket, self.flats, strict=True):
            masters = [next(it) for _ in pieces]
            if b.size == 1 and not self.separate:
                continue  # the masters are the parameters themselves
            dtype = b.params[0].dtype if len({p.dtype for p in b.params}) == 1 else torch.float32
            local = torch.zeros(b.shard, dtype=dtype, device=b.params[0].device)  # [shard]
            if flat is not None:
                local[:flat.numel()].copy_(flat)
            else:
                for pc, m in zip(pieces, masters, strict=True):
                    local[pc.at:pc.at + pc.numel].copy_(m)
            full = gather_bucket(b, local)  # [padded]
            for p, off in zip(b.params, b.offsets, strict=True):
                p.view(-1).copy_(full[off:off + p.numel()])

    @torch.no_grad()
    def gathered(self) -> dict[nn.Parameter, torch.Tensor]:
        """float32 value of every local parameter, shaped like it (collective over each bucket's group);
        empty when the parameters are the masters."""
        if not self.separate:
            return {}
        out = {}
        for (_, b), flat in zip(self.layout.buckets, self.flats, strict=True):
            assert flat is not None, "separate masters hold every bucket's elements"
            local = torch.zeros(b.shard, dtype=torch.float32, device=flat.device)
            local[:flat.numel()].copy_(flat)
            full = gather_bucket(b, local)
            for p, off in zip(b.params, b.offsets, strict=True):
                out[p] = full[off:off + p.numel()].view(p.shape).clone()
        return out

    @torch.no_grad()
    def load(self, values: dict[nn.Parameter, torch.Tensor]) -> None:
        """Set the masters from full-precision local parameter values (no collective)."""
        if not self.separate:
            return
        for pc, m in zip(self.layout.pieces, self.params, strict=True):
            if pc.param in values:
                m.copy_(values[pc.param].reshape(-1)[pc.lo:pc.hi])

    def state(self) -> list[torch.Tensor | None]:
        return [None if f is None else f.detach().clone() for f in self.flats]

    @torch.no_grad()
    def load_state(self, flats: list[torch.Tensor | None]) -> None:
        for mine, saved in zip(self.flats, flats, strict=True):
            if mine is not None:
                assert saved is not None, "the saved masters come from the same layout"
                mine.copy_(saved)
        if self.separate:
            self.publish()
