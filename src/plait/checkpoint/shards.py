"""Where each local tensor of a ParallelModel sits in the full tensor, and loading local slices from any reader.

A *region* is ``(dim, start, stop)``: this rank holds ``full.narrow(dim, start, stop - start)``
(zero-padded up to the local size for a vocabulary padded to a multiple of tp), or the whole tensor when
``dim`` is None. A *reader* is ``read(key, dim, start, stop) -> tensor``: a Hugging Face folder or a
plait checkpoint, each reading only the requested slice from its safetensors files. ``init_local`` fills
the slices with the model's seeded initial values instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.tensor_parallel.layers import TPShardedModule

if TYPE_CHECKING:
    from plait.parallel_model import ParallelModel

Reader = Callable[[str, "int | None", int, "int | None"], torch.Tensor]


@dataclass
class LocalTensor:
    """One state tensor of this rank, with its place in the full tensor."""

    key: str
    tensor: torch.Tensor
    dim: int | None
    start: int
    stop: int  # exclusive; stop - start may be smaller than the local size (vocabulary padding)
    full_shape: list[int]
    #: the dim tensor parallelism cuts this tensor along under any tp (``dim`` is None under tp 1); None: never cut
    split: int | None = None

    @property
    def valid(self) -> torch.Tensor:
        """The part of the local tensor that is real data (padding rows dropped)."""
        if self.dim is None:
            return self.tensor
        return self.tensor.narrow(self.dim, 0, self.stop - self.start)


def local_tensors(pm: ParallelModel) -> Iterator[LocalTensor]:
    """Every state tensor of ``pm``'s chunks on this rank, keyed as in the plain model, with its region."""
    ctx = pm.ctx
    for chunk in pm.chunks.values():
        for key, tensor in chunk.named_state().items():
            module, attr = chunk.owner(key)
            shape = list(tensor.shape)
            dims = getattr(module, "shard_dims", {}) if isinstance(module, TPShardedModule) else {}
            dim, full = dims.get(attr, (None, 0))
            if dim is None or ctx.tp_size == 1:
                yield LocalTensor(key, tensor, None, 0, shape[0] if shape else 0, shape, dim)
                continue
            n = shape[dim]
            start = min(ctx.tp_rank * n, full)
            stop = min(start + n, full)
            full_shape = shape[:dim] + [full] + shape[dim + 1:]
            yield LocalTensor(key, tensor, dim, start, stop, full_shape, dim)


@torch.no_grad()
def load_local(pm: ParallelModel, read: Reader, keys_ok: Callable[[str], bool] | None = None) -> None:
    """Fill this rank's tensors from ``read`` (only the slices it owns). No collective (except under ZeRO-3 with
    ``keys_ok``: the parameters left alone are gathered first)."""
    with pm.full_parameters(gather=keys_ok is not None, write_back=True):  # ZeRO-3: whole, then into the shards
        for lt in local_tensors(pm):
            if keys_ok is not None and not keys_ok(lt.key):
                continue
            data = read(lt.key, lt.dim, lt.start, lt.stop) if lt.dim is not None else read(lt.key, None, 0, None)
            copy_padded(lt.tensor, data, lt.dim)


@torch.no_grad()
def init_local(pm: ParallelModel, seed: int) -> None:
    """Fill this rank's tensors with the model's seeded initial values (plait.models.init), one full tensor
    at a time: draw it, keep this rank's slice, drop it. Every layout gets the weights that
    ``plait.models.init.init_weights(plain_model, seed)`` gives on one device. No collective."""
    family, config = pm.family, pm.model_config
    with pm.full_parameters(gather=False, write_back=True):  # ZeRO-3: whole, then into the shards
        for lt in local_tensors(pm):
            full = family.init_tensor(config, lt.key, tuple(lt.full_shape), seed)
            local = full if lt.dim is None else full.narrow(lt.dim, lt.start, lt.stop - lt.start)
            copy_padded(lt.tensor, local, lt.dim)
            del full, local  # before the next one is drawn


def copy_padded(dst: torch.Tensor, src: torch.Tensor, dim: int | None) -> None:
    src = src.to(dtype=dst.dtype, device=dst.device)
    if dim is None or src.shape[dim] == dst.shape[dim]:
        dst.copy_(src.view_as(dst))
        return
    dst.zero_()
    dst.narrow(dim, 0, src.shape[dim]).copy_(src)


def param_keys(pm: ParallelModel) -> dict[int, str]:
    """id(parameter) -> its plain key (first one seen), for optimizer state."""
    out: dict[int, str] = {}
    for lt in local_tensors(pm):
        if isinstance(lt.tensor, nn.Parameter):
            out.setdefault(id(lt.tensor), lt.key)
    return out
