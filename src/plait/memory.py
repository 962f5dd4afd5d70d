"""Per-rank memory accounting of a real step: bytes of parameters, gradients and optimizer state, and the peak
of the tensors autograd saves for backward (the activations)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class _Held:
    """What autograd keeps instead of a saved tensor while the meter runs; its death releases the storage."""

    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: int, tensor: torch.Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self):
        self.meter.release(self.key)


class SavedTensorMeter:
    """Live bytes of the storages autograd holds for backward, and their peak, while ``hooks()`` is active.

    Every tensor an op saves goes through ``torch.autograd.graph.saved_tensors_hooks``: autograd keeps a
    small holder instead, and a storage is counted when its first holder appears and released when its last
    holder dies (autograd frees saved tensors once the node's backward has run). Views of one storage, and a
    tensor saved by several ops, count once. Storages in ``exclude`` (parameters, their per-step
    low-precision copies, module buffers) are weights, not activations, and are skipped. Tensors saved inside
    a ``torch.utils.checkpoint`` region go through its own hooks instead (recomputed, not stored).
    ``live_weights``: storage addresses of weights allocated while the step runs (ZeRO-3's gathered parameters),
    a set its owner keeps current; skipped too.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (), live_weights: set[int] | None = None):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude if t.device.type != "meta"}
        self.live_weights = live_weights if live_weights is not None else set()
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no plain storage (e.g. sparse): not counted
            return t
        key = st.data_ptr()
        if key == 0 or key in self.exclude or key in self.live_weights:
            return t
        n = self.refs.get(key, 0)
        if n == 0:
            self.sizes[key] = st.nbytes()
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] = n + 1
        return _Held(self, key, t)

    @staticmethod
    def _unpack(h):
        return h.tensor if isinstance(h, _Held) else h

    def release(self, key: int) -> None:
        n = self.refs.get(key, 0) - 1
        if n > 0:
            self.refs[key] = n
            return
        self.refs.pop(key, None)
        self.live -= self.sizes.pop(key, 0)


@runtime_checkable
class CountsItsBytes(Protocol):
    """An optimizer that counts the bytes it holds (``plait.optim.ParallelOptimizer``: its state and masters)."""

    def memory_bytes(self) -> int: ...


#: what ``ParallelModel.attach_optimizer`` takes and ``optimizer_bytes`` counts
Optimizer = CountsItsBytes | torch.optim.Optimizer


def optimizer_bytes(optimizer: Optimizer | None) -> int:
    """Bytes an optimizer holds: its own count if it keeps one (``memory_bytes()``), else its state tensors."""
    if optimizer is None:
        return 0
    if isinstance(optimizer, CountsItsBytes):
        return int(optimizer.memory_bytes())
    return storage_bytes(t for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t))


def report(params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor | None], optimizer: Optimizer | None,
           activations_peak: int | None) -> dict[str, int | None]:
    """The dict ``ParallelModel.memory_report()`` returns (bytes on this rank; see there)."""
    return {"params": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": optimizer_bytes(optimizer),
            "activations_peak": activations_peak}
