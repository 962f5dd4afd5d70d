"""Device facts the runtime needs without assuming CUDA: synchronising clocks, copies to the device, allocator
memory, host syncs, and placing a meta-built module on its device.

On a CPU every call here is cheap or a no-op; on a GPU kernels run asynchronously, so a wall-clock time
read without ``synchronize`` measures the launches, not the work, and a Python value read from a device
tensor (``.item()``, ``float(t)``, ``if t > 0``) stalls the host until the device catches up.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: Tensor operations that read a tensor's value on the host: the host waits for the device to get there.
VALUE_READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "equal",
                         "allclose", "nonzero"})
#: Tensor operations that copy a device tensor to the host (they count only from a non-CPU device).
HOST_COPIES = frozenset({"cpu", "to", "copy_"})


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on ``device`` is done (a no-op on CPU, whose operations run in order)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host``'s copy on ``device``, queued without making the host wait where the device allows it.

    A copy to a GPU from pageable memory returns only when the device has run everything queued before it,
    so the host stops running ahead of the kernels; from pinned (page-locked) memory with ``non_blocking``
    the copy is queued like a kernel, and kernels queued after it see the copied values (same stream).
    """
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def accelerator_name() -> str | None:
    """This host's first GPU as its driver names it (e.g. "NVIDIA H200", "NVIDIA H100 80GB HBM3"), or None
    on a host without one."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new window for ``peak_allocated`` (a no-op without a caching allocator)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> int | None:
    """Peak bytes the device allocator handed out since the last reset; None where there is no allocator to
    ask (CPU: plait's own census, ``plait.memory``, is the figure there)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


class HostSyncCounter(TorchFunctionMode):
    """Counts the operations inside its ``with`` block that copy a value of a ``device`` tensor to the host.

    On a GPU each of them waits for every kernel queued before it; in a training step's hot loop they serialise
    the host with the device. On a CPU they cost nothing, but counting them there tells what a GPU run will pay
    (value reads of every CPU tensor count, so on CPU the count is an upper bound of the GPU's; copies count only
    from a non-CPU device). ``counts`` maps the operation's name to its calls; ``total`` is their sum.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__()
        self.device = torch.device(device)
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name in VALUE_READS or name in HOST_COPIES) and self._syncs(name, args, kwargs):
            self.counts[name] += 1
        return func(*args, **kwargs)

    def _syncs(self, name: str, args: tuple, kwargs: dict) -> bool:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name in VALUE_READS:
            return any(t.device.type == self.device.type for t in tensors)
        if name == "copy_":  # dst.copy_(src): a device source into a host destination
            return len(tensors) == 2 and tensors[0].device.type == "cpu" and tensors[1].device.type != "cpu"
        if not tensors or tensors[0].device.type == "cpu":
            return False  # already on the host
        if name == "cpu":
            return True
        target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        return target is not None and torch.device(target).type == "cpu"


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialised) every meta tensor of ``module`` on ``device``, keeping each Parameter object:
    ties, TP-partial marks and gradient groups refer to those objects (``to_empty`` would replace them)."""
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None and p.is_meta:
                real = nn.Parameter(_empty(p, device), requires_grad=p.requires_grad)
                real.__dict__.update(p.__dict__)  # swap_tensors exchanges __dict__ too: keep our marks
                torch.utils.swap_tensors(p, real)
        for name, b in sub._buffers.items():
            if b is not None and b.is_meta:
                sub._buffers[name] = _empty(b, device)


def _empty(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of ``t``'s shape and dtype on ``device`` (``empty_like`` of a meta tensor would
    import PyTorch's symbolic-shape machinery: seconds of start-up)."""
    return torch.empty(t.shape, dtype=t.dtype, device=device)
