"""Sequence parallelism's region input kept as its shard for the backward and all-gathered again there.

Under SP a TP region (the attention's Q, K, V; the MLP's gate and up) all-gathers its sequence-sharded input
[B, S/t, H] into one [B, S, H] tensor that its column-parallel projections consume. A projection needs that
input again only for its weight gradient. As Megatron-LM does (``LinearWithGradAccumulationAndAsyncCommunication``
with ``sequence_parallel``; Korthikanti et al. 2022, §4.2.2), the projections keep the shard instead and the
backward all-gathers it again, once per region: the first projection whose backward runs gathers it, the
region's other projections reuse that tensor, and the last one lets it go (a weight gradient deferred to a
zero-bubble W pass keeps the tensor in its own closure until then). The cost: one more all-gather per region
in the backward; the gain: B·S·H·(t-1)/t fewer elements kept per region.

The region's gathered tensor carries its ``Regather`` (``attach``); the projections look for it on the tensor
they receive (``kept_input``) and hand it to ``plait.weight_grad.linear``, which saves the shard in the
projection's own autograd node. Anything computed from the gathered tensor carries nothing and is kept as
usual. Saving in the projections' nodes, rather than in ``saved_tensors_hooks`` pushed for the region's
forward, leaves any outer saved-tensor hooks in charge of everything else the region saves (hooks pushed inside
the region would take their place there): plait's ``SavedTensorMeter`` (``memory_report``, which then counts
the shard) and a checkpoint around the block (which then saves, and recomputes, the shard too).
"""

from __future__ import annotations

import torch

from plait.tensor_parallel import comms
from plait.weight_grad import KeptInput

_ATTR = "_plait_regather"


class _Gathered:
    """The re-gathered input shared by one region's projections in one backward: how many still need it."""

    __slots__ = ("dim", "group", "users", "full")

    def __init__(self, dim: int, group):
        self.dim, self.group = dim, group
        self.users = 0
        self.full: torch.Tensor | None = None

    def restore(self, shard: torch.Tensor) -> torch.Tensor:
        """The gathered input again: all-gathered by the region's first projection to ask, then shared; dropped
        once every projection that kept the shard has asked."""
        full = self.full
        if full is None:
            full = comms.all_gather(shard, self.dim, self.group)  # the forward gather's own code
        self.users -= 1
        self.full = full if self.users > 0 else None
        return full


class Regather:
    """What a region's gathered input is kept as: this rank's shard, and the state the projections share."""

    __slots__ = ("shard", "gathered")

    def __init__(self, shard: torch.Tensor, dim: int, group):
        self.shard = shard.detach()
        self.gathered = _Gathered(dim, group)

    def kept(self) -> KeptInput:
        """(the tensor a projection saves instead of the gathered input, the function that gives the input
        back from it in the backward); counts the projection among those the re-gathered tensor serves."""
        self.gathered.users += 1
        return self.shard, self.gathered.restore


def attach(gathered: torch.Tensor, shard: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Mark a region's ``gathered`` input (``comms.gather_seq`` of ``shard`` along ``dim``) as kept as the shard."""
    setattr(gathered, _ATTR, Regather(shard, dim, group))  # noqa: B010 (read by kept_input)
    return gathered


def kept_input(x: torch.Tensor) -> KeptInput | None:
    """How a projection keeps ``x`` for its weight gradient: ``Regather.kept()`` when ``x`` is a region's
    gathered input marked by ``attach``, else None (``x`` itself is saved)."""
    mark = getattr(x, _ATTR, None)
    return mark.kept() if isinstance(mark, Regather) and torch.is_grad_enabled() else None
