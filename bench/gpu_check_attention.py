"""``bench/gpu_check.py``'s attention section: causal SDPA's speed on this device by sequence length and head
dimension, for each of torch's fused backends, beside the planner's cost of the same attention.

The grid is FlashAttention's own benchmark (``plan.attention``'s source): ``TOKENS`` tokens a pass, as
``TOKENS / s`` sequences of s = 512 ... 16k, at head dimension 64 and 128, with the heads of a hidden size of 1024,
2048 (the benchmark's) and 4096; and the train section's attention as plait's Llama runs it (its batch, sequence,
query and KV heads, grouped-query through SDPA's ``enable_gqa``, the query a transposed view of its projection).
Every shape runs in bf16 (float32 on a CPU), causal, its forward and its forward + backward (the gradients of q, k
and v from a fixed output gradient), under each of SDPA's fused backends forced in turn (flash, cuDNN, efficient;
one that cannot run the shape records why), timed with CUDA events around enough calls for about 10 ms after two
untimed ones (``gpu_check_gemm.seconds_per_call``); each shape in two passes, the list in order, then reversed.
Which backend SDPA picks unforced is read from the profiler's operator names.

TFLOP/s count the FLOPs ``plan.attention`` counts: a forward of 4·b·s²·heads·d / 2 (the causal half of QK^T and
AV), a backward of 2.5 forwards. Where the catalogue knows the GPU (``catalogue.gpu_of_device``) each shape carries
the planner's speed for it (``plan.attention.efficiency`` times the GPU's peak) for the kernels ``flash2`` and
``cudnn``, the same for forward and backward, as ``plan.gpu`` charges them. ``attention.json`` keeps every timing.
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from pathlib import Path

from gpu_check_gemm import seconds_per_call

TOKENS = 16384
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
HIDDENS = (1024, 2048, 4096)
#: a CPU's grid: enough to run every path of the section in a second
CPU_TOKENS, CPU_SEQS, CPU_HEAD_DIMS, CPU_HIDDENS = 256, (64, 128), (32,), (64, 128)
#: SDPA's fused backends (``torch.nn.attention.SDPBackend`` members) by the names this section records
BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
#: the planner's kernels (``plan.attention.KERNELS``) set beside each shape, and the backend that runs each
PLANNER_KERNELS = {"flash2": "flash", "cudnn": "cudnn"}
MODES = ("forward", "fwd_bwd")
#: seconds after which no shape's pass starts (the grid takes about half of it on an H200)
BUDGET_S = 50.0


def causal_forward_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """FLOPs of a causal attention forward as ``plan.attention`` counts them: QK^T and AV on half the s×s square."""
    return 4 * batch * seq * seq * heads * head_dim / 2


def shapes(quick_cpu: bool, model: dict, batch: int, seq: int) -> list[dict]:
    """The grid, then the train section's attention (``model``, ``batch``, ``seq``) as plait's Llama lays it out."""
    tokens, seqs, dims, hiddens = (CPU_TOKENS, CPU_SEQS, CPU_HEAD_DIMS, CPU_HIDDENS) if quick_cpu else \
        (TOKENS, SEQS, HEAD_DIMS, HIDDENS)
    grid = [{"case": f"h{h}", "batch": tokens // s, "seq": s, "heads": h // d, "kv_heads": h // d, "head_dim": d}
            for h in hiddens for d in dims for s in seqs]
    d = model["dim"] // model["n_heads"]
    return grid + [{"case": "plait", "batch": batch, "seq": seq, "heads": model["n_heads"],
                    "kv_heads": model["n_kv_heads"], "head_dim": d}]


def calls(torch, device, dtype, shape: dict) -> dict:
    """mode -> the call: a causal SDPA forward, and a forward + backward to q, k and v's gradients."""
    import torch.nn.functional as F

    b, s, h, kv, d = (shape[k] for k in ("batch", "seq", "heads", "kv_heads", "head_dim"))
    gen = torch.Generator(device=device).manual_seed(0)

    def heads(n: int):  # [B, n, S, d], laid out [B, S, n, d] as plait's projections leave it
        x = torch.randn(b, s, n, d, device=device, dtype=dtype, generator=gen).transpose(1, 2)
        return x.requires_grad_()

    q, k, v = heads(h), heads(kv), heads(kv)
    grad = torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen)
    gqa = h != kv

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return {"forward": forward, "fwd_bwd": lambda: torch.autograd.grad(forward(), (q, k, v), grad)}


def default_backend(fn) -> str:
    """The backend SDPA runs ``fn``'s attention with when none is forced, from the operator names of the autograd
    profiler without Kineto (host operators only: Kineto's start costs seconds, the operators' names are all this
    reads)."""
    from torch.autograd.profiler import profile

    with profile(use_kineto=False) as prof:
        fn()
    names = [e.key for e in prof.key_averages() if "_scaled_dot_product_" in e.key]
    for name in ("cudnn", "flash", "efficient", "math"):
        if any(name in n for n in names):
            return name
    return ",".join(names) or "none"


def time_backend(torch, device, fn, backend: str, work_s: float) -> float | str:
    """Seconds a call of ``fn`` under ``backend`` alone, or why SDPA refuses it there (its warning, or its error)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with warnings.catch_warnings(record=True) as why, sdpa_kernel(getattr(SDPBackend, BACKENDS[backend])):
        warnings.simplefilter("always")
        try:
            return seconds_per_call(fn, device, work_s, 200, events=True)
        except RuntimeError as exc:
            return " ".join(str(w.message).replace("\n", " ") for w in why)[:400] or str(exc).splitlines()[0]


def planner_tflops(gpu, seq: int, head_dim: int) -> dict:
    """The planner's speed (TFLOP/s) of causal attention at ``seq`` and ``head_dim`` on catalogue ``gpu`` for each
    kernel of ``PLANNER_KERNELS`` it has figures for there (``plan.attention.kernel_of`` refuses the others)."""
    from plait.errors import ConfigError
    from plait.plan.attention import efficiency, kernel_of

    out = {}
    for kernel in PLANNER_KERNELS:
        try:
            kernel_of(kernel, gpu)
        except ConfigError:
            continue
        out[kernel] = round(efficiency(gpu, kernel, seq, head_dim) * gpu.peak_flops / 1e12, 1)
    return out


def attention_section(device, sizes: dict, quick: bool, out: Path, budget_s: float = BUDGET_S) -> dict:
    """The grid timed (``attention.json``) and summed up (``summary``); a shape's pass that would start after
    ``budget_s`` seconds is left out and counted (``shape_passes_cut``)."""
    import torch

    from plait.devices import accelerator_name
    from plait.plan.catalogue import gpu_of_device

    cuda = device.type == "cuda"
    dtype, name = (torch.bfloat16, accelerator_name() or "cuda") if cuda else (torch.float32, "cpu")
    rows = shapes(not cuda, sizes["model"], sizes["batch"], sizes["seq"])
    gpu = gpu_of_device(name) if cuda else None
    seconds: dict[tuple[int, str, str], list[float]] = {}
    refused: dict[tuple[int, str], str] = {}
    order, started, cut = list(range(len(rows))), time.perf_counter(), 0
    for index in order + order[::-1]:
        if time.perf_counter() - started > budget_s:
            cut += 1
            continue
        shape = rows[index]
        table = calls(torch, device, dtype, shape)
        shape.setdefault("default_backend", default_backend(table["fwd_bwd"]))
        for backend in BACKENDS:
            for mode in MODES:
                if (index, backend) in refused:
                    continue
                got = time_backend(torch, device, table[mode], backend, 0.01 if cuda else 0.002)
                if isinstance(got, str):
                    refused[(index, backend)] = got
                else:
                    seconds.setdefault((index, backend, mode), []).append(got)
        del table
    for index, shape in enumerate(rows):
        flops = causal_forward_flops(shape["batch"], shape["heads"], shape["seq"], shape["head_dim"])
        shape.setdefault("default_backend", None)
        shape["tflops"] = {b: {m: [float(f"{f * flops / t / 1e12:.4g}") for t in seconds.get((index, b, m), [])]
                               for f, m in zip((1.0, 3.5), MODES, strict=True)} if (index, b) not in refused
                           else {"refused": refused[(index, b)]} for b in BACKENDS}
        shape["planner_tflops"] = planner_tflops(gpu, shape["seq"], shape["head_dim"]) if gpu else {}
    version = {"torch": torch.__version__, "cuda": torch.version.cuda,
               "cudnn": torch.backends.cudnn.version() if cuda else None}
    (out / "attention.json").write_text(json.dumps({"device": name, "dtype": str(dtype).replace("torch.", ""),
                                                    **version, "shapes": rows}, indent=1) + "\n")
    return {**summary(rows, gpu.name if gpu else None), "shape_passes_cut": cut}


def summary(rows: list[dict], planner_gpu: str | None) -> dict:
    """The section's keys: the backends SDPA picked, each backend's median forward + backward TFLOP/s over the
    grid and over the planner's figure for its kernel, the two passes' median scatter, and the train section's
    attention (its backend, measured and planned speeds)."""
    def mean(pair: list[float]) -> float:
        return statistics.fmean(pair)

    def timed(row: dict, backend: str) -> bool:
        return bool(row["tflops"][backend].get("fwd_bwd"))

    grid, plait = [r for r in rows if r["case"] != "plait"], rows[-1]
    pairs = [pair for r in rows for b in r["tflops"].values() for pair in b.values()
             if isinstance(pair, list) and len(pair) == 2]
    result: dict = {"shapes": len(rows), "planner_gpu": planner_gpu,
                    "default_backends": ",".join(sorted({r["default_backend"] for r in grid if r["default_backend"]})),
                    "median_pass_scatter": round(statistics.median(abs(a - b) / max(a, b) for a, b in pairs), 4)
                    if pairs else None}
    for backend in BACKENDS:
        ran = [r for r in grid if timed(r, backend)]
        result[f"{backend}_shapes_run"] = len(ran)
        result[f"{backend}_median_fwd_bwd_tflops"] = round(statistics.median(
            mean(r["tflops"][backend]["fwd_bwd"]) for r in ran), 4) if ran else None
    for kernel, backend in PLANNER_KERNELS.items():
        ratios = [mean(r["tflops"][backend]["fwd_bwd"]) / r["planner_tflops"][kernel] for r in grid
                  if timed(r, backend) and kernel in r["planner_tflops"]]
        result[f"{backend}_over_planner_{kernel}"] = round(statistics.median(ratios), 3) if ratios else None
    result["plait_backend"] = plait["default_backend"]
    own = plait["default_backend"]
    result["plait_fwd_bwd_tflops"] = round(mean(plait["tflops"][own]["fwd_bwd"]), 4) \
        if own in BACKENDS and timed(plait, own) else None
    for kernel in PLANNER_KERNELS:
        result[f"plait_planner_{kernel}_tflops"] = plait["planner_tflops"].get(kernel)
    return result
