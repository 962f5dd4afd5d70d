"""``bench/gpu_check.py``'s gemm section: this device's GEMM speeds beside the planner's cost of each GEMM.

On a GPU it times ``torch.mm`` in bf16 on the shapes of ``plait.plan.measured_gemm_h200`` (every GEMM of the
published runs' layers and a grid across wave boundaries and reduction depths) the way they were measured there:
two untimed calls, then about 20 ms of calls timed, each shape in two passes (the list in order, then reversed).
Where the catalogue knows the GPU (``catalogue.gpu_of_device``) it reports how the planner's GEMM cost
(``plan.gemm.gemm_seconds``) follows the speeds: their correlation and the mean error after one common scale,
beside the same for tile and wave quantization alone and for one flat speed. ``gemm.json`` keeps every timing,
the data a new ``plan.measured_*`` module of that GPU would hold. On a CPU it times a few small float32 shapes.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

#: float32 shapes for a CPU: the grid's reduction-depth sweep at m = n = 256
CPU_SHAPES = tuple((256, 256, k) for k in (16, 64, 256, 1024, 4096))


def seconds_per_call(fn, device, work_s: float, max_calls: int, events: bool = False) -> float:
    """Seconds per call of ``fn()`` on ``device``: two untimed calls, then enough calls for about ``work_s`` (3 to
    ``max_calls``), timed on the host around a device synchronize, or with ``events`` on a CUDA device between two
    CUDA events (the device's own clock, no host time at either end)."""
    import torch

    from plait.devices import synchronize

    for _ in range(2):
        fn()
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    calls = int(min(max_calls, max(3, work_s / max(time.perf_counter() - t0, 1e-7))))
    if events and device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / calls


def _time(torch, device, m: int, n: int, k: int, dtype, work_s: float) -> float:
    """FLOP/s of ``torch.mm`` of an [m, k] and a [k, n] matrix on ``device`` (``seconds_per_call``, 3 to 50 calls)."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return 2 * m * n * k / seconds_per_call(lambda: torch.mm(a, b), device, work_s, 50)


def gemm_section(device, quick: bool, out: Path) -> dict:
    import torch

    from plait.devices import accelerator_name
    from plait.plan.catalogue import gpu_of_device
    from plait.plan.gemm import scaled_error
    from plait.plan.measured_gemm_h200 import GRID, PUBLISHED

    cuda = device.type == "cuda"
    if cuda:
        # the grid crosses some published shapes: each is timed once a pass
        shapes = list(dict.fromkeys((s.m, s.n, s.k) for s in PUBLISHED + GRID))[:: 4 if quick else 1]
        dtype, name = torch.bfloat16, accelerator_name() or "cuda"
    else:
        shapes, dtype, name = list(CPU_SHAPES), torch.float32, "cpu"
    speeds: dict[tuple[int, int, int], list[float]] = {}
    for order in (shapes, shapes[::-1]):
        for m, n, k in order:
            speeds.setdefault((m, n, k), []).append(_time(torch, device, m, n, k, dtype, 0.02 if cuda else 0.005))
    measured = [statistics.fmean(speeds[s]) for s in shapes]
    (out / "gemm.json").write_text(json.dumps({
        "device": name, "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
        "shapes": [{"m": m, "n": n, "k": k, "tflops": [round(v / 1e12, 2) for v in speeds[(m, n, k)]]}
                   for m, n, k in shapes]}, indent=1) + "\n")
    scatter = statistics.median(abs(a - b) / max(a, b) for a, b in speeds.values())
    result: dict = {"shapes": len(shapes), "dtype": str(dtype).replace("torch.", ""),
                    "best_tflops": round(max(measured) / 1e12, 2), "median_pass_scatter": round(scatter, 4),
                    "flat_scaled_error": round(scaled_error([1.0] * len(shapes), measured), 4),
                    "planner_gpu": None, "planner_correlation": None, "planner_scaled_error": None,
                    "quantization_correlation": None}
    gpu = gpu_of_device(name) if cuda else None
    if gpu is not None:
        result.update(planner_fit(gpu, shapes, measured))
    return result


def planner_fit(gpu, shapes: list[tuple[int, int, int]], measured: list[float]) -> dict:
    """How the planner's cost of each GEMM on catalogue ``gpu`` follows the ``measured`` FLOP/s of ``shapes``:
    their correlation and mean error after one common scale, and the correlation of tile and wave quantization
    on the GPU's SMs alone (whether or not the catalogue costs the GPU with it; None without an SM count)."""
    from plait.plan.gemm import gemm_seconds, quantization, scaled_error

    ours = [2 * m * n * k / gemm_seconds(gpu, m, n, k) for m, n, k in shapes]
    tiles = [quantization(m, n, gpu.sms) for m, n, _ in shapes] if gpu.sms else None
    return {"planner_gpu": gpu.name, "planner_correlation": round(statistics.correlation(ours, measured), 3),
            "planner_scaled_error": round(scaled_error(ours, measured), 4),
            "quantization_correlation": round(statistics.correlation(tiles, measured), 3) if tiles else None}
