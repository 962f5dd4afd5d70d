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


def test_quantised_weights_memory_and_speed():
    """Seed table: Llama 3 70B weights are 141 GB at bf16/fp16, 71 at int8 (or fp8), 35 at int4."""
    m = Model.preset("llama3-70b")
    one = Cluster("b200", 1)
    for weights, gb in (("bf16", 141.1), ("fp16", 141.1), ("int8", 70.6), ("fp8", 70.6), ("int4", 35.3)):
        o = plan_inference(m, one, Workload(1, 1024, 256), weights=weights).options[0]
        assert o.weights_gb == __import__("pytest").approx(gb, abs=0.1), weights
    a100 = Cluster("a100-80gb", 1)
    assert not plan_inference(m, a100, Workload(1, 1024, 256), weights="bf16").options[0].fits
    int4 = plan_inference(m, a100, Workload(1, 1024, 256), weights="int4").best
    assert int4 is not None and (int4.tp, int4.pp) == (1, 1)
    # decode is memory bound: a quarter of the bytes streams about four times faster
    h = Cluster("h100-sxm", 8)
    bf16 = next(o for o in plan_inference(m, h, Workload(1), weights="bf16").options if (o.tp, o.pp) == (8, 1))
    q4 = next(o for o in plan_inference(m, h, Workload(1), weights="int4").options if (o.tp, o.pp) == (8, 1))
    assert 3.5 < bf16.breakdown_ms["memory"] / q4.breakdown_ms["memory"] < 4.01


def test_tp_over_ethernet_is_not_recommended_when_pp_serves_better():
    m = Model.preset("llama3-405b")  # 810 GB of bf16 weights: two nodes of 8 H100
    res = plan_inference(m, Cluster("h100-sxm", 16, interconnect="eth-100"), Workload(8, 1024, 256))
    tp16 = next(o for o in res.options if (o.tp, o.pp) == (16, 1))
    best = res.best
    assert tp16.fits and best.tp <= 8 and best.pp == 2  # PP crosses the Ethernet, TP stays on NVLink
    assert best.request_ms < tp16.request_ms and best.ttft_ms < tp16.ttft_ms
    assert any("crosses nodes" in w and "link latency" in w for w in tp16.warnings)
    assert tp16.tp_allreduce_bytes == 8 * m.hidden * 2 and 0 < tp16.tp_latency_ms < tp16.tp_allreduce_ms


def test_prompt_groups_flow_through_the_stages():
    """plait serve cuts the running batch into up to pp groups: a step is groups + pp - 1 stage ticks."""
    m = Model.preset("llama3-8b")
    c = Cluster("h100-sxm", 4)
    one = next(o for o in plan_inference(m, c, Workload(1)).options if (o.tp, o.pp) == (1, 4))
    eight = next(o for o in plan_inference(m, c, Workload(8)).options if (o.tp, o.pp) == (1, 4))
    assert one.groups == 1 and eight.groups == 4
    # memory-bound stages: 7 ticks of (nearly) the same length instead of 4
    assert 7 / 4 * 0.95 < eight.token_latency_ms / one.token_latency_ms < 7 / 4 * 1.2


def test_topo_says_what_plan_says():
    from typer.testing import CliRunner

    from plait.cli.main import app
    from plait.plan.topo import serving_advice

    w = Workload(8, 1024, 256)
    for text, gpu in ((PCIE.replace("SYS", "PIX"), "l40s"), (DGX, "h100-sxm")):
        t = parse_topo(text)
        topo_best = serving_advice(t, Model.preset("llama3-70b"), gpu, w, "int4").best
        plan_best = plan_inference(Model.preset("llama3-70b"), Cluster(gpu, 4, gpus_per_node=4), w, "int4").best
        assert (topo_best.tp, topo_best.pp, topo_best.replicas) == (plan_best.tp, plan_best.pp, plan_best.replicas)
        assert topo_best.request_ms == __import__("pytest").approx(plan_best.request_ms)
    # across sockets (SYS) TP4 pays more than on one switch: its all-reduces are slower
    sys_t, pix_t = parse_topo(PCIE), parse_topo(PCIE.replace("SYS", "PIX"))
    tp4 = [next(o for o in serving_advice(t, Model.preset("llama3-70b"), "l40s", w, "int4").options if o.tp == 4)
           for t in (sys_t, pix_t)]
    assert tp4[0].tp_allreduce_ms > tp4[1].tp_allreduce_ms
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(PCIE.replace("SYS", "PIX"))
    r = CliRunner().invoke(app, ["topo", "--file", f.name, "--model", "llama3-70b", "--gpu", "l40s", "--batch", "8",
                                 "--weights", "int4"])
    p = CliRunner().invoke(app, ["plan", "--model", "llama3-70b", "--gpus", "4", "--gpu", "l40s", "--inference",
                                 "--batch", "8", "--weights", "int4"])
    verdict = next(ln for ln in p.output.splitlines() if ln.startswith("best: "))
    assert r.exit_code == 0 and "• " + verdict in r.output
