"""Inference planning and the nvidia-smi topology reader."""

from plait.plan import Cluster, Model, Workload, parse_topo, plan_inference
from plait.plan.topo import advice, tp_groups

DGX = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV12\tNV12\tNV12\tPXB\t0-63\t0\t\tN/A
GPU1\tNV12\t X \tNV12\tNV12\tPXB\t0-63\t0\t\tN/A
GPU2\tNV12\tNV12\t X \tNV12\tSYS\t64-127\t1\t\tN/A
GPU3\tNV12\tNV12\tNV12\t X \tSYS\t64-127\t1\t\tN/A
NIC0\tPXB\tPXB\tSYS\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks
"""

PCIE = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity
GPU0     X      PIX     SYS     SYS     0-15            0
GPU1    PIX      X      SYS     SYS     0-15            0
GPU2    SYS     SYS      X      PIX     16-31           1
GPU3    SYS     SYS     PIX      X      16-31           1
"""


def test_70b_on_4_a100_picks_tp4():
    res = plan_inference(Model.preset("llama3-70b"), Cluster("a100-80gb", 4), Workload(8, 1024, 256))
    best = res.best
    assert best is not None and (best.tp, best.pp) == (4, 1) and not best.warnings
    pp4 = next(o for o in res.options if (o.tp, o.pp) == (1, 4))
    assert pp4.fits and pp4.token_latency_ms > 2 * best.token_latency_ms  # stages run one after another
    assert next(o for o in res.options if (o.tp, o.pp, o.replicas) == (1, 1, 4)).fits is False
    # bf16 weights: 141 GB over 4 GPUs; KV: 80 layers × 2 × 8 heads × 128 × 2 B = 320 KiB per token,
    # /4 GPUs, × 8 sequences × 1280 tokens
    assert best.weights_gb == __import__("pytest").approx(141.1 / 4, rel=0.02)
    assert best.kv_cache_gb == __import__("pytest").approx(80 * 2 * 2 * 128 * 2 * 8 * 1280 / 1e9, rel=1e-6)


def test_tp_over_pcie_warns():
    res = plan_inference(Model.preset("llama3-8b"), Cluster("l40s", 4), Workload(1, 512, 128))
    tp4 = next(o for o in res.options if o.tp == 4)
    assert any("PCIe" in w for w in tp4.warnings)
    res = plan_inference(Model.preset("llama3-8b"), Cluster("h100-sxm", 16, gpus_per_node=8), Workload(1, 512, 128))
    assert any("crosses nodes" in w for o in res.options if o.tp == 16 for w in o.warnings)


def test_topo_parser_nvlink_sample():
    t = parse_topo(DGX)
    assert t.gpus == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert t.links[(0, 3)] == "NV12" and t.links[(2, 2)] == "X" and t.grade(1, 2) == "good"
    assert tp_groups(t) == [[0, 1, 2, 3]]
    assert "tp=4" in advice(t)[0]


def test_topo_parser_pcie_sample():
    t = parse_topo(PCIE)
    assert t.grade(0, 1) == "fair" and t.grade(0, 2) == "bad"
    lines = advice(t)
    assert "no NVLink" in lines[0] and any(ln.startswith("SYS") and "0-2" in ln for ln in lines)
