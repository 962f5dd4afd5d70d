"""``bench/gpu_check.py``'s elementwise section: how fast this device runs the kinds of element-wise kernel plait's
eager training step launches (``plait.plan.eager`` counts them), each at the shape the train section's model gives
it, against the bytes the planner charges for it at the device's bandwidth.

Each case is one kernel of that count, on the train section's tokens (T = batch · S), hidden size h, heads and head
size hd, MLP width f, in the train section's dtype (bf16 on a GPU): SwiGLU's product of two [T, f] tensors
(contiguous), a residual sum of two [T, h] (contiguous), the norm's cast of [T, h] to float32 and ``rms_norm`` on
it, a norm weight's product [T, h] · [h] (broadcast), RoPE's product of q, the [B, heads, S, hd] transpose of its
projection, with the [S, hd] table (broadcast, strided), the copy torch's ``roll`` makes of that transpose, the
roll of the copy, and the sum of the two RoPE products, whose layouts differ. ``plan.eager`` counts each as its
tensors' bytes read and written once; the section reports the bytes over the measured time (GB/s) and, where the
catalogue knows the GPU, its share of the catalogue's bandwidth. Timed as the gemm section times a GEMM: two
untimed calls, then enough calls for about 20 ms (3 to 200) between two synchronizes, each case in two passes
(the list in order, then reversed), the two passes' mean kept.
"""

from __future__ import annotations

import statistics

from gpu_check_gemm import seconds_per_call


def cases(torch, device, dtype, model: dict, batch: int, seq: int) -> dict:
    """name -> (the kernel as a call, the bytes it reads and writes as ``plan.eager`` counts them, whether it runs
    torch's generic strided loop: ``plan.eager.Kernel.strided``; None for the roll, a kernel of its own)."""
    import torch.nn.functional as F

    h, heads, f = model["dim"], model["n_heads"], model["ffn_dim"]
    hd, t, a = h // heads, batch * seq, torch.finfo(dtype).bits // 8
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    gate, up, x, y, w = randn(t, f), randn(t, f), randn(t, h), randn(t, h), randn(h)
    x32 = x.float()
    q = randn(batch, seq, heads, hd).transpose(1, 2)  # [B, heads, S, hd], laid out [B, S, heads, hd]
    cos = randn(seq, hd)
    qc = q.contiguous()
    rotated = q * cos
    n, nq = t * h, t * heads * hd
    out = {
        "mul_contiguous": (lambda: gate * up, 3 * a * t * f, False),
        "add_contiguous": (lambda: x + y, 3 * a * n, False),
        "cast_to_fp32": (lambda: x.float(), (a + 4) * n, False),  # none in float32: left out below
        "rms_norm_fp32": (lambda: F.rms_norm(x32, (h,)), 8 * n, False),
        "mul_norm_weight": (lambda: w * y, 2 * a * n, True),
        "mul_rope_table": (lambda: q * cos, 2 * a * nq, True),
        "copy_transpose": (lambda: q.contiguous(), 2 * a * nq, True),
        "roll": (lambda: qc.roll(hd // 2, -1), 2 * a * nq, None),  # its own kernel: in neither share
        "add_mixed_layouts": (lambda: rotated + qc, 3 * a * nq, True),
    }
    if dtype == torch.float32:
        del out["cast_to_fp32"]
    return out


def elementwise_section(device, sizes: dict, quick: bool) -> dict:
    import torch

    from plait.devices import accelerator_name
    from plait.plan.catalogue import gpu_of_device

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    table = cases(torch, device, dtype, sizes["model"], sizes["batch"], sizes["seq"])
    names = list(table)
    seconds: dict[str, list[float]] = {}
    for order in (names, names[::-1]):
        for name in order:
            fn, _, _ = table[name]
            work_s = 0.02 if cuda and not quick else 0.005
            seconds.setdefault(name, []).append(seconds_per_call(fn, device, work_s, 200))
    gpu = gpu_of_device(accelerator_name() or "") if cuda else None
    bandwidth = gpu.memory_bandwidth if gpu is not None else None
    result: dict = {"dtype": str(dtype).replace("torch.", ""), "planner_gpu": gpu.name if gpu else None,
                    "bandwidth_gb_s": bandwidth / 1e9 if bandwidth else None}
    shares: dict[bool, list[float]] = {False: [], True: []}
    for name in names:
        _, nbytes, strided = table[name]
        rate = nbytes / statistics.fmean(seconds[name])
        result[f"{name}_gb_s"] = float(f"{rate / 1e9:.4g}")  # four figures: a loaded CPU's small rates stay above 0
        if bandwidth and strided is not None:
            shares[strided].append(rate / bandwidth)
    result["contiguous_share"] = round(statistics.median(shares[False]), 3) if shares[False] else None
    result["strided_share"] = round(statistics.median(shares[True]), 3) if shares[True] else None
    return result
