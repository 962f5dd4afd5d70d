"""Hardware catalogue: GPUs, their links inside a node, and inter-node interconnects."""

from __future__ import annotations

from dataclasses import dataclass

from plait.errors import FieldError

GiB = 1024**3
GB = 1e9


@dataclass(frozen=True)
class Link:
    """A link class: bandwidth per GPU per direction (bytes/s) and per-hop latency (s). ``ring_bandwidth``: where
    NCCL runs one communicator's ring across a node through fewer NICs than the group has members there, the most
    that ring moves per direction whatever its members (0: no such cap; ``GpuCosts.group_link``)."""

    name: str
    bandwidth: float
    latency: float
    ring_bandwidth: float = 0.0


@dataclass(frozen=True)
class KernelRates:
    """How fast one GPU type runs the kinds of element-wise kernel plait's eager training step launches
    (``plan.eager.KINDS``), each timed alone at a run's shapes, and where that was measured (``source``). A kernel of
    a measured kind runs at its rate (bytes read and written, as ``plan.eager`` counts them, a second); any other
    at the datasheet bandwidth times the share the measured kinds reached, their median: ``contiguous_share`` for
    one whose operands are contiguous, ``strided_share`` for one that runs torch's generic strided loop
    (``plan.eager.Kernel.strided``). Measured in bf16: a float32 run's kernels take the same rates."""

    source: str
    measured: tuple[tuple[str, float], ...]
    """(kind, bytes/s) of each kind measured."""
    contiguous_share: float
    strided_share: float

    def rate(self, kind: str, strided: bool, bandwidth: float) -> float:
        """Bytes/s of a kernel of ``kind`` ("" for none), ``strided`` or not, on a GPU of datasheet ``bandwidth``."""
        measured = dict(self.measured)
        if kind in measured:
            return measured[kind]
        return bandwidth * (self.strided_share if strided else self.contiguous_share)


@dataclass(frozen=True)
class GPU:
    """One accelerator type.

    ``peak_flops`` is the dense bf16/fp16 tensor-core peak (no sparsity); ``matmul_efficiency`` the
    best share of it large GEMMs reach in practice (see ``docs/planner.md``, "How accurate: published runs").
    The datasheet cost model's other constants (``plan.gpu``) ride on the entry too, so that one GPU type can be
    costed with other values (``plan.validation`` refits them with a source held out): ``elementwise_traffic``
    (HBM bytes the element-wise kernels move per stored activation byte) and ``flash_efficiency`` (the share of
    peak a fused flash-attention kernel reaches, forward and backward, where no published figures describe the
    GPU). ``attention_figures`` names the published attention benchmarks that do (``plan.attention.FIGURES``:
    "a100", "h100"; "" for none). ``sms``: its streaming multiprocessors, as the vendor's architecture whitepaper
    prints them (0 where none is cited). ``tile_quantization``: its GEMMs are costed with cuBLAS's tile and wave
    quantization on those SMs (``plan.gemm``: the A100s, which the guide describes; not the Hopper GPUs, whose
    measured GEMM speeds show none: ``plan.measured_gemm_h200``). ``elementwise_rates``: plait's eager
    element-wise kernels as measured on this GPU (``KernelRates``; None where they were not: they run at
    ``memory_bandwidth``).
    """

    name: str
    peak_flops: float
    memory: float
    memory_bandwidth: float
    intra: Link
    inter: Link
    matmul_efficiency: float
    description: str = ""
    fp8: bool = False  # fp8 tensor cores (twice the bf16 peak)
    elementwise_traffic: float = 2.06
    flash_efficiency: float = 0.5
    attention_figures: str = ""
    sms: int = 0
    tile_quantization: bool = False
    elementwise_rates: KernelRates | None = None


# Link figures are vendor nominal per direction per GPU; NCCL reaches LINK_EFFICIENCY of them
# (nccl-tests bus bandwidth: ~360-400 GB/s of 450 on H100 NVLink4, ~22 of 25 GB/s on HDR IB).
# The latencies (a ring step's, ``plan.gpu``: 3 µs over NVLink, 5 over InfiniBand, 8 over RoCE and PCIe, 20-30
# over Ethernet) are not sourced. NCCL's own tuning model (src/graph/tuning.cc, the same figures in v2.7.8 through
# v2.23.4) charges its Simple-protocol ring 3.4 µs a hop over NVLink, 5.7 over PCIe and 9.6 over the network, plus
# 8.4 µs a collective, and sums the hops along the ring (the network hops once per node), but picks each
# collective's algorithm and protocol by bandwidths from its topology search; docs/planner.md ("Where it misses",
# DeepSpeed's ZeRO-3) says what its ring figures alone did to the published runs.
LINK_EFFICIENCY = 0.8

NVLINK3 = Link("NVLink3 (NVSwitch)", 300 * GB, 3e-6)
NVLINK4 = Link("NVLink4 (NVSwitch)", 450 * GB, 3e-6)
NVLINK5 = Link("NVLink5 (NVSwitch)", 900 * GB, 3e-6)
PCIE4 = Link("PCIe gen4 x16", 32 * GB, 8e-6)
PCIE5 = Link("PCIe gen5 x16", 64 * GB, 8e-6)
SHM = Link("shared memory", 20 * GB, 2e-6)

INTERCONNECTS: dict[str, Link] = {
    "ib-hdr": Link("InfiniBand HDR 200 Gb/s per GPU", 25 * GB, 5e-6),
    "ib-ndr": Link("InfiniBand NDR 400 Gb/s per GPU", 50 * GB, 5e-6),
    "ib-xdr": Link("InfiniBand XDR 800 Gb/s per GPU", 100 * GB, 5e-6),
    "roce-400": Link("RoCE 400 Gb/s per GPU", 50 * GB, 8e-6),
    "eth-100": Link("Ethernet 100 Gb/s per node", 12.5 * GB / 8, 20e-6),
    "eth-10": Link("Ethernet 10 Gb/s per node", 1.25 * GB / 8, 30e-6),
}

# matmul_efficiency and elementwise_traffic: fitted on the published runs of ``plan.published`` (A100: 63 runs
# from 6 sources, 0.717; H100: 27 runs from 3 sources, 0.664; the traffic 2.06 on all 90; ``bench/plan.py
# --validate`` refits them and reports each source's error with that source held out;
# tests/test_plan_gpu.py checks these are the fit).
# H100 PCIe and H200 share the H100 figure; B200, L40S and the CPU are guesses not calibrated on any
# published run (docs/planner.md). Fused attention: the A100s take the A100 80GB benchmarks, the H100s and H200
# (Hopper, the same SMs) the H100 SXM5's, as shares of their own peak (``plan.attention``).
# Peak dense bf16 FLOP/s, memory and bandwidth from the vendors' datasheets (A100: 312 TF, 1.6/2.0
# TB/s; H100 SXM: 989 TF, 3.35 TB/s; H100 PCIe: 756 TF, 2.0 TB/s; H200: 989 TF, 141 GB, 4.8 TB/s;
# B200 (HGX): 2.25 PF, 180 GB, 8 TB/s; L40S: 362 TF, 48 GB, 864 GB/s). SMs: "NVIDIA A100 Tensor Core GPU
# Architecture" (2020): 108; "NVIDIA H100 Tensor Core GPU Architecture" (2022): 132 on the SXM5, 114 on the PCIe
# card; the H200 is the SXM5's GH100 with more memory.
# The H200's: bf16 at the shapes of make gpu-check's train section (a 0.6B Llama: 4 x 2,048 tokens of width 1,536,
# 12 heads of 128, MLP 4,096), each kind timed alone with CUDA synchronizes around enough calls for 20 ms, in two
# passes (bench/gpu_check_elementwise.py); torch 2.11.0+cu130, CUDA 13.0. GB/s over the bytes plan.eager counts.
H200_ELEMENTWISE = KernelRates(
    "bench/gpu_check.py elementwise section, H200, torch 2.11, 2026-11-30",
    (("mul_contiguous", 4101 * GB), ("add_contiguous", 3771 * GB), ("cast_to_fp32", 1854 * GB),
     ("rms_norm_fp32", 3366 * GB), ("mul_norm_weight", 1502 * GB), ("mul_rope_table", 1192 * GB),
     ("copy_transpose", 1354 * GB), ("roll", 861.7 * GB), ("add_mixed_layouts", 1720 * GB)),
    contiguous_share=0.743, strided_share=0.297)

GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("a100-40gb", 312e12, 40 * GiB, 1.555e12, NVLINK3, INTERCONNECTS["ib-hdr"], 0.717,
            "NVIDIA A100 SXM 40GB", attention_figures="a100", sms=108, tile_quantization=True),
        GPU("a100-80gb", 312e12, 80 * GiB, 2.039e12, NVLINK3, INTERCONNECTS["ib-hdr"], 0.717,
            "NVIDIA A100 SXM 80GB", attention_figures="a100", sms=108, tile_quantization=True),
        GPU("h100-sxm", 989e12, 80 * GiB, 3.35e12, NVLINK4, INTERCONNECTS["ib-ndr"], 0.664,
            "NVIDIA H100 SXM5 80GB", fp8=True, attention_figures="h100", sms=132),
        GPU("h100-pcie", 756e12, 80 * GiB, 2.0e12, PCIE5, INTERCONNECTS["ib-ndr"], 0.664,
            "NVIDIA H100 PCIe 80GB (no NVLink bridge)", fp8=True,
            attention_figures="h100", sms=114),
        GPU("h200", 989e12, 141 * GB, 4.8e12, NVLINK4, INTERCONNECTS["ib-ndr"], 0.664,
            "NVIDIA H200 SXM 141GB", fp8=True, attention_figures="h100", sms=132,
            elementwise_rates=H200_ELEMENTWISE),
        GPU("b200", 2.25e15, 180 * GB, 8.0e12, NVLINK5, INTERCONNECTS["ib-ndr"], 0.60,
            "NVIDIA B200 (HGX) 180GB", fp8=True),
        GPU("l40s", 362e12, 48 * GiB, 0.864e12, PCIE4, INTERCONNECTS["eth-100"], 0.60,
            "NVIDIA L40S 48GB (PCIe, no NVLink)", fp8=True),
        GPU("cpu", 1e12, 64 * GiB, 100 * GB, SHM, INTERCONNECTS["eth-10"], 0.5,
            "generic CPU host (Gloo), for local runs"),
    )
}


def get_gpu(name: str | GPU) -> GPU:
    """The catalogue entry for ``name`` (case-insensitive); raises ConfigError listing valid names."""
    if isinstance(name, GPU):
        return name
    key = str(name).lower().replace("_", "-")
    aliases = {"h100": "h100-sxm", "a100": "a100-80gb", "a100-80": "a100-80gb", "a100-40": "a100-40gb"}
    key = aliases.get(key, key)
    if key not in GPUS:
        raise FieldError("gpu", name, f"unknown GPU; valid: {', '.join(GPUS)}")
    return GPUS[key]


def gpu_of_device(device_name: str) -> GPU | None:
    """The catalogue GPU a device's driver name denotes ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100
    PCIe", "NVIDIA A100-SXM4-40GB", "NVIDIA L40S"), or None for one the catalogue does not hold (an A100 PCIe,
    a consumer card)."""
    name = device_name.lower()
    if "h100" in name:
        return GPUS["h100-pcie" if "pcie" in name else "h100-sxm"]
    if "a100" in name:
        return None if "pcie" in name else GPUS["a100-40gb" if "40gb" in name else "a100-80gb"]
    return next((GPUS[key] for key in ("h200", "b200", "l40s") if key in name), None)


def get_interconnect(name: str | Link | None, gpu: GPU) -> Link:
    """The inter-node link: ``None`` means the GPU's usual fabric; a name from INTERCONNECTS."""
    if name is None:
        return gpu.inter
    if isinstance(name, Link):
        return name
    if name not in INTERCONNECTS:
        raise FieldError("interconnect", name, f"unknown; valid: {', '.join(INTERCONNECTS)}")
    return INTERCONNECTS[name]
