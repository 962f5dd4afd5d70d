"""A cluster: its devices, how they are linked, and the one cost model chosen when it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from plait.errors import FieldError
from plait.plan.attention import UNFUSED, kernel_of
from plait.plan.catalogue import GPU, Link, get_gpu, get_interconnect
from plait.plan.costs import CostModel
from plait.plan.gpu import GpuCosts
from plait.plan.host.costs import HostCosts, host_gpu
from plait.plan.host.profile import HostProfile

#: share of each device's memory a layout may use by default (the rest: the runtime's context, communication
#: buffers, the allocator's fragmentation, temporary buffers); ``Cluster(max_memory_fraction=...)`` changes it
MAX_MEMORY_FRACTION = 0.9


@dataclass(frozen=True, init=False)
class Cluster:
    """``n_gpus`` accelerators of one type (``gpu``: a ``GPU`` or a catalogue name), ``gpus_per_node`` to a node.

    ``interconnect`` names the inter-node fabric (``catalogue.INTERCONNECTS``); None = the GPU's usual.
    ``profile``: a calibrated host (``plait calibrate``; ``Cluster.from_profile``); then ``n_gpus`` is the
    number of plait processes on that one host, ``gpu`` is derived from the profile, and step times and memory
    are those of plait's own eager runtime measured there (``plan.host``); else catalogue GPUs are costed as
    published Megatron-LM runs (``plan.gpu``). ``costs`` is that cost model, chosen here once.
    ``flash_attention``: the attention kernel; catalogue GPUs only. True (the default): a fused flash-attention
    kernel, FlashAttention-2 (PyTorch SDPA's flash backend); "sdpa": the kernel PyTorch's SDPA, which plait's
    runtime calls, runs on that GPU (``plan.attention.sdpa_kernel``: cuDNN's on Hopper and the B200); a name from
    ``plan.attention.KERNELS`` picks the kernel ("flash1", "triton-ops", "flash2", "cudnn" for cuDNN's fused
    attention, "flash3"), each costed at its published speed on that GPU by sequence length and head dimension;
    False: the unfused softmax of Megatron-LM's early runs (the s×s scores go through HBM and are stored).
    ``attention`` is the kernel resolved ("unfused" for False), ``flash_attention`` whether it is fused.
    """

    gpu: GPU
    n_gpus: int
    gpus_per_node: int
    interconnect: Link
    profile: HostProfile | None
    max_memory_fraction: float
    flash_attention: bool
    attention: str
    costs: CostModel = field(repr=False, compare=False)

    def __init__(self, gpu: GPU | str, n_gpus: int, gpus_per_node: int = 8, interconnect: str | Link | None = None,
                 profile: HostProfile | None = None, max_memory_fraction: float = MAX_MEMORY_FRACTION,
                 flash_attention: bool | str = True) -> None:
        if int(n_gpus) < 1:
            raise FieldError("n_gpus", n_gpus, "must be >= 1")
        costs: CostModel
        if profile is not None:
            gpu, gpus_per_node = host_gpu(profile, int(n_gpus)), int(n_gpus)
            costs = HostCosts(profile, int(n_gpus))
        else:
            costs = GpuCosts(self)
        if int(gpus_per_node) < 1:
            raise FieldError("gpus_per_node", gpus_per_node, "must be >= 1")
        if not 0 < max_memory_fraction <= 1:
            raise FieldError("max_memory_fraction", max_memory_fraction, "must be in (0, 1]")
        device = get_gpu(gpu)
        kernel = kernel_of(flash_attention, device)
        for name, value in (("gpu", device), ("n_gpus", n_gpus), ("gpus_per_node", gpus_per_node),
                            ("interconnect", get_interconnect(interconnect, device)), ("profile", profile),
                            ("max_memory_fraction", max_memory_fraction), ("flash_attention", kernel != UNFUSED),
                            ("attention", kernel), ("costs", costs)):
            object.__setattr__(self, name, value)

    @classmethod
    def from_profile(cls, profile: HostProfile | str | Path, processes: int,
                     max_memory_fraction: float = MAX_MEMORY_FRACTION) -> Cluster:
        """``processes`` plait processes on the calibrated host of ``profile`` (a HostProfile or a path)."""
        prof = profile if isinstance(profile, HostProfile) else HostProfile.load(profile)
        return cls("cpu", processes, profile=prof, max_memory_fraction=max_memory_fraction)

    @property
    def usable_memory(self) -> float:
        """Bytes of one device a layout may use: ``max_memory_fraction`` of its memory."""
        return self.max_memory_fraction * self.gpu.memory

    def link(self, group_span: int) -> Link:
        """The link a ring over ``group_span`` consecutive ranks uses: NVLink/PCIe inside a node."""
        return self.gpu.intra if group_span <= self.gpus_per_node else self.interconnect
