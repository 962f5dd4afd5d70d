"""Fused attention kernels: the share of a GPU's peak each reaches, by sequence length and head dimension, as
their authors' published benchmarks print it.

Every figure below is forward + backward TFLOP/s of a causal kernel, counted as the kernels' own benchmark counts
them (Dao-AILab/flash-attention ``benchmarks/benchmark_flash_attention.py``, commit 60499abc): a forward of
``4·b·s²·heads·d / 2`` FLOPs (the causal half of QK^T and AV), a backward of 2.5 forwards, so that ``TFLOP/s /
peak`` is directly the efficiency ``plan.gpu`` charges the causal half of the square at. The benchmark runs
``16k / s`` sequences of hidden size 2048 (16 heads of 128 or 32 of 64) at s = 512 ... 16k.
"""

from __future__ import annotations

import math

from plait.errors import ConfigError
from plait.plan.catalogue import GPU

UNFUSED = "unfused"
#: ``Cluster(flash_attention="sdpa")``: the kernel PyTorch's SDPA runs on the cluster's GPU (``sdpa_kernel``)
SDPA = "sdpa"
#: The fused kernels the datasheet model knows; ``Cluster(flash_attention=...)`` names one of them.
KERNELS = {
    "flash1": "FlashAttention (Dao et al. 2022)",
    "triton-ops": "OpenAI Triton's fused attention (triton.ops.flash_attention)",
    "flash2": "FlashAttention-2 (Dao 2023); PyTorch's SDPA flash backend",
    "cudnn": "cuDNN's fused flash attention (Transformer Engine's FusedAttention; PyTorch SDPA's on Hopper)",
    "flash3": "FlashAttention-3 (Shah et al. 2024), Hopper only",
}
#: What ``Cluster(flash_attention=True)`` means: FlashAttention-2, PyTorch's SDPA flash backend
DEFAULT_KERNEL = "flash2"
#: The catalogue GPUs of compute capability 9.0 and 10.0 (Hopper, B200), where PyTorch's SDPA tries cuDNN's fused
#: attention before its flash backend (``check_prefer_cudnn_attention`` in torch's
#: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, from cuDNN 9.15 on; ``TORCH_CUDNN_SDPA_DEPRIORITIZED``
#: turns it off; ``plan.measured_attention_h200`` records SDPA picking it on an H200).
SDPA_CUDNN_FIRST = frozenset({"h100-sxm", "h100-pcie", "h200", "b200"})
SEQ = (512, 1024, 2048, 4096, 8192, 16384)  # the benchmarks' sequence lengths
Series = dict[int, tuple[float, ...]]  # head dimension -> TFLOP/s at each of SEQ

# A100 80GB SXM4 (peak 312 TFLOP/s): Dao-AILab/flash-attention README, assets/flash2_a100_fwd_bwd_benchmark.png
# (commit 4f285b35, the FlashAttention-2 release; Dao 2023, Figure 4), panels (c) and (d): with causal mask, head
# dimension 64 and 128; bars "FlashAttention" (flash1), "FlashAttention Triton" and "FlashAttention-2" (flash2).
# The Triton bars are OpenAI Triton's own fused attention: the benchmark that draws them
# (benchmarks/benchmark_flash_attention.py at 60499abc) imports ``from triton.ops.flash_attention import attention
# as attention_triton`` from Triton's main branch ("triton-ops"), not FlashAttention's Triton port
# (flash_attn/flash_attn_triton.py, which llm-foundry copies and runs on the pre-MLIR compiler), which has no
# published speed. The H100 figure of the same README has no Triton bar.
_A100: dict[str, Series] = {
    "flash1": {64: (58, 70, 77, 87, 92, 97), 128: (55, 62, 69, 76, 80, 83)},
    "triton-ops": {64: (59, 75, 79, 76, 79, 80), 128: (50, 61, 68, 74, 78, 80)},
    "flash2": {64: (88, 119, 140, 156, 165, 171), 128: (99, 133, 155, 173, 182, 189)},
}
# H100 80GB SXM5 (peak 989): the same README, assets/flash2_h100_fwd_bwd_benchmark.png, panels (c) and (d).
_H100: dict[str, Series] = {
    "flash1": {64: (104, 123, 136, 138, 149, 156), 128: (98, 109, 108, 126, 135, 137)},
    "flash2": {64: (141, 192, 232, 257, 273, 284), 128: (163, 221, 265, 294, 308, 328)},
}
# H100 SXM5, Shah et al. 2024 (FlashAttention-3, arXiv 2407.08608; the forward also in the README's
# assets/flash3_fp16_fwd.png): forward with causal mask (Figure 5 (b), (d)), forward without (5 (a), (c)) and
# backward without (Figure 6), head dimension 64 and 128; bars "cuDNN" and "FlashAttention-3". The paper prints no
# causal backward: ``_causal_fwd_bwd`` derives it.
_H100_FA3 = {
    "cudnn": {64: ((225, 288, 334, 363, 379, 388), (335, 373, 399, 408, 412, 413), (266, 348, 395, 417, 432, 433)),
              128: ((315, 410, 484, 518, 529, 539), (497, 574, 617, 609, 600, 595),
                    (305, 408, 465, 499, 518, 516))},
    "flash3": {64: ((197, 265, 371, 420, 460, 473), (333, 392, 460, 476, 496, 497), (272, 363, 422, 453, 472, 474)),
               128: ((292, 423, 521, 579, 602, 616), (467, 565, 625, 638, 646, 648),
                     (316, 424, 501, 542, 559, 561))},
}


def _causal_fwd_bwd(fwd_causal: float, fwd_full: float, bwd_full: float) -> float:
    """Forward + backward TFLOP/s of a causal kernel from its causal forward and its full-square forward and
    backward: the causal backward is taken to lose what the causal forward loses against the full one (the
    diagonal blocks, half masked, weigh the same in both passes), and the pair costs 1 + 2.5 forwards.
    On FlashAttention-2, whose causal forward + backward the README prints, this gives 138-277 TFLOP/s at head
    dimension 64 against the printed 141-284, and 145-303 at 128 against 163-328 (the paper's FlashAttention
    2.5.8 beside the README's 2.0)."""
    bwd_causal = bwd_full * fwd_causal / fwd_full
    return 3.5 / (1 / fwd_causal + 2.5 / bwd_causal)


_H100.update({k: {d: tuple(_causal_fwd_bwd(*p) for p in zip(*series, strict=True)) for d, series in dims.items()}
              for k, dims in _H100_FA3.items()})
#: per figure set (``GPU.attention_figures``): the benchmark GPU's peak and each kernel's TFLOP/s by head dimension
FIGURES: dict[str, tuple[float, dict[str, Series]]] = {
    "a100": (312e12, _A100),
    "h100": (989e12, _H100),
}


def kernel_of(flash_attention: bool | str, gpu: GPU) -> str:
    """The kernel ``Cluster(flash_attention=...)`` asks for on ``gpu``: False or "unfused", the unfused softmax;
    True, ``DEFAULT_KERNEL``; "sdpa", the one PyTorch's SDPA runs there (``sdpa_kernel``); else a name from
    ``KERNELS`` that has figures on ``gpu`` (any name on a GPU with no published figures, which every fused kernel
    costs at ``GPU.flash_efficiency``)."""
    if flash_attention is False or flash_attention == UNFUSED:
        return UNFUSED
    if flash_attention is True:
        return DEFAULT_KERNEL
    if flash_attention == SDPA:
        return sdpa_kernel(gpu)
    if flash_attention not in KERNELS:
        raise ConfigError(f"flash_attention: unknown kernel {flash_attention!r}; valid: True, False, {SDPA}, "
                          f"{', '.join(KERNELS)}, {UNFUSED}")
    if gpu.attention_figures in FIGURES and flash_attention not in FIGURES[gpu.attention_figures][1]:
        have = ", ".join(FIGURES[gpu.attention_figures][1])
        why = "runs on Hopper GPUs only" if flash_attention == "flash3" else f"has no published speed on {gpu.name}"
        raise ConfigError(f"flash_attention: {flash_attention!r} {why}; valid on {gpu.name}: {have}, True, False")
    return str(flash_attention)


def sdpa_kernel(gpu: GPU) -> str:
    """The kernel PyTorch's SDPA, which plait's runtime calls for causal attention, runs on catalogue ``gpu``:
    cuDNN's on the GPUs of ``SDPA_CUDNN_FIRST``, FlashAttention-2 (``DEFAULT_KERNEL``) elsewhere."""
    return "cudnn" if gpu.name in SDPA_CUDNN_FIRST else DEFAULT_KERNEL


def _interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise linear through (xs, ys), flat beyond the ends (numpy's ``interp``; the planner imports no
    numpy, so that it starts at once: tests/test_architecture.py)."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[-1]


def efficiency(gpu: GPU, kernel: str, seq: float, head_dim: float) -> float:
    """Share of ``gpu``'s peak that ``kernel`` reaches on the causal half of the s×s square, forward and backward
    alike: its published TFLOP/s over the benchmark GPU's peak, linear in log2(seq) between the benchmarked
    lengths and in the head dimension between 64 and 128, flat beyond them. A GPU with no figures (or a GPU type
    the figures do not name) takes ``gpu.flash_efficiency``."""
    if gpu.attention_figures not in FIGURES:
        return gpu.flash_efficiency
    peak, kernels = FIGURES[gpu.attention_figures]
    dims = kernels[kernel]
    logs = tuple(math.log2(s) for s in SEQ)
    at = {d: _interpolate(logs, tflops, math.log2(max(seq, 1.0))) for d, tflops in dims.items()}
    ds = tuple(sorted(at))
    return _interpolate(ds, tuple(at[d] for d in ds), head_dim) * 1e12 / peak


def window_share(seq_len: float, window: int | None) -> float:
    """The share of a causal attention's query-key pairs over ``seq_len`` tokens that a sliding window of
    ``window`` keys (itself included) keeps: the query at position p sees min(p + 1, W) keys, so W(W+1)/2 +
    (s-W)·W of the causal s(s+1)/2 pairs; 1.0 without a window or with one that spans the sequence."""
    if window is None or window >= seq_len:
        return 1.0
    return (window * (window + 1) / 2 + (seq_len - window) * window) / (seq_len * (seq_len + 1) / 2)
