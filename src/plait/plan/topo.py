"""Read ``nvidia-smi topo -m`` and say which GPUs are close enough for tensor parallelism."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, replace

from plait.plan.catalogue import GPU, NVLINK4, PCIE5, Link, get_gpu
from plait.plan.cluster import Cluster
from plait.plan.inference import InferenceResult, Workload
from plait.plan.model import Model

# How good each connection type of ``nvidia-smi topo -m`` is for TP's per-layer all-reduces.
GRADES = {
    "NV": ("good", "NVLink: suits TP"),
    "PIX": ("fair", "one PCIe switch: TP works, slower than NVLink"),
    "PXB": ("fair", "several PCIe switches: TP works, slower than NVLink"),
    "PHB": ("poor", "through the CPU's PCIe host bridge: TP pays a slow hop"),
    "NODE": ("poor", "across PCIe host bridges in one NUMA node: TP pays a slow hop"),
    "SYS": ("bad", "across NUMA nodes (QPI/UPI): the slowest path for TP"),
    "X": ("self", "self"),
}


@dataclass(frozen=True)
class Topology:
    """GPU names and the connection type between every pair (``links[(i, j)]``, e.g. ``NV12``)."""

    gpus: list[str]
    links: dict[tuple[int, int], str]

    def grade(self, i: int, j: int) -> str:
        return GRADES[_kind(self.links[(i, j)])][0]


def _kind(code: str) -> str:
    return "NV" if code.startswith("NV") else code


def parse_topo(text: str) -> Topology:
    """Parse the matrix printed by ``nvidia-smi topo -m`` (NIC rows/columns and legend ignored).

    Raises ValueError if no GPU matrix is found.
    """
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header = next((ln for ln in lines if re.match(r"^\s*GPU0\b", ln)), None)
    if header is None:
        raise ValueError("no 'GPU0 GPU1 ...' header line in the nvidia-smi topo -m output")
    cols = [c for c in re.split(r"\s+", header.strip()) if re.fullmatch(r"(GPU|NIC)\d+|mlx\S+", c)]
    gpus = [c for c in cols if c.startswith("GPU")]
    links: dict[tuple[int, int], str] = {}
    for ln in lines:
        cells = re.split(r"\s+", ln.strip())
        m = re.fullmatch(r"GPU(\d+)", cells[0])
        if not m or ln == header or len(cells) < len(cols) + 1:
            continue
        i = int(m.group(1))
        for name, code in zip(cols, cells[1:1 + len(cols)], strict=True):
            if name.startswith("GPU"):
                links[(i, int(name[3:]))] = code
    if not links:
        raise ValueError("no GPU rows in the nvidia-smi topo -m output")
    return Topology(gpus, links)


def tp_groups(topo: Topology) -> list[list[int]]:
    """Largest sets of GPUs joined pairwise by NVLink (greedy cliques), largest first."""
    n = len(topo.gpus)
    left = set(range(n))
    groups: list[list[int]] = []
    while left:
        seed = min(left)
        group = [seed]
        for j in sorted(left - {seed}):
            if all(topo.grade(i, j) == "good" for i in group):
                group.append(j)
        groups.append(group)
        left -= set(group)
    return sorted(groups, key=len, reverse=True)


def advice(topo: Topology) -> list[str]:
    """Human-readable advice: TP groups over NVLink, and which pairs to keep TP away from."""
    groups = tp_groups(topo)
    out = []
    big = groups[0]
    if len(big) > 1:
        tp = 1 << (len(big).bit_length() - 1)
        out.append(f"NVLink joins GPUs {big}: tensor parallelism up to tp={tp} inside that group")
    else:
        out.append("no NVLink between GPUs: any tensor parallelism runs over PCIe (whether it pays: see below)")
    worst: dict[str, list[tuple[int, int]]] = {}
    for (i, j), code in sorted(topo.links.items()):
        if i < j and topo.grade(i, j) in ("poor", "bad", "fair"):
            worst.setdefault(_kind(code), []).append((i, j))
    for kind, pairs in worst.items():
        shown = ", ".join(f"{i}-{j}" for i, j in pairs[:6]) + (" …" if len(pairs) > 6 else "")
        out.append(f"{kind}: {GRADES[kind][1]} (pairs {shown})")
    return out


def read_topo() -> str | None:
    """The output of ``nvidia-smi topo -m``, or None when nvidia-smi is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


# The link a TP group gets, by the worst connection between its GPUs. NVLink and one-switch PCIe are the
# GPU's own (catalogue); host-bridge and cross-socket hops are rough guesses: half and a quarter of
# PCIe gen5's bandwidth, with more latency per hop.
_SLOW = {"poor": Link("PCIe through the host bridge", 32e9, 12e-6),
         "bad": Link("PCIe across NUMA nodes (QPI/UPI)", 16e9, 20e-6)}


def _link(topo: Topology, gpu: GPU, tp: int) -> Link:
    """The link of a TP group of the first ``tp`` GPUs: its worst pairwise connection."""
    grades = {topo.grade(i, j) for i in range(tp) for j in range(tp) if i != j}
    for worst in ("bad", "poor"):
        if worst in grades:
            return _SLOW[worst]
    if "fair" in grades:
        return gpu.intra if "PCIe" in gpu.intra.name else PCIE5
    return gpu.intra if "NVLink" in gpu.intra.name else NVLINK4


def serving_advice(topo: Topology, model: Model, gpu: str | GPU, workload: Workload,
                   weights: str = "bf16") -> InferenceResult:
    """``plan_inference`` on these GPUs, each TP size costed on the link its group would use: the same
    model and ranking as ``plait plan --inference``."""
    from plait.plan.inference import plan_inference, rank

    base = get_gpu(gpu)
    n = len(topo.gpus)
    options = []
    for tp in (d for d in (1, 2, 4, 8, 16) if d <= n and n % d == 0):
        g = replace(base, intra=_link(topo, base, tp))
        options += plan_inference(model, Cluster(g, n, gpus_per_node=n), workload, weights, tps=[tp]).options
    return InferenceResult(rank(options), model, Cluster(base, n, gpus_per_node=n), workload)
