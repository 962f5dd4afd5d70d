"""Causal attention speeds measured on an NVIDIA H200: which kernel PyTorch's SDPA runs there and how fast, the
evidence for ``plan.attention.sdpa_kernel`` and for how far ``plan.attention``'s published figures hold on it.

Measured 2026-11-30 on one NVIDIA H200 (132 SMs; torch 2.11.0+cu130, CUDA 13.0, cuDNN 9.19.0) by
``bench/gpu_check.py``'s attention section (``bench/gpu_check_attention.py``), twice: run A at 00:43 UTC (the section
alone), run B at 01:05 (within a whole ``make gpu-check``). Causal ``scaled_dot_product_attention`` in bf16 on q, k
and v drawn by ``torch.randn`` as [B, S, heads, d] and viewed as [B, heads, S, d] (plait's layout), its forward and
its forward + backward (``torch.autograd.grad`` of q, k and v from a fixed output gradient), under each fused
backend forced in turn (``torch.nn.attention.sdpa_kernel``): two untimed calls, then calls for about 10 ms between
two CUDA events; every shape in two passes (the list in order, then reversed), both kept. TFLOP/s count
``plan.attention``'s FLOPs: a forward of 4·b·s²·heads·d / 2 (the causal half), a backward of 2.5 forwards.
``picked`` is the backend SDPA ran unforced (the autograd profiler's operator name).

Shapes: FlashAttention's benchmark grid (``plan.attention``'s source), 16,384 tokens as 16k / s sequences of
s = 512 ... 16k, at head dimension 64 and 128, with the heads of hidden size 1,024, 2,048 (the benchmark's) and 4,096
(36 shapes); and the attention of ``make gpu-check``'s train section as plait's Llama calls it ("plait": batch 4 of
2,048 tokens, 12 query heads sharing 4 KV heads through ``enable_gqa``, d = 128), which SDPA's memory-efficient
backend refuses ("both fused kernels require query, key and value to have the same num_heads").

What they show (``tests/test_plan_attention_measured.py`` checks it; a shape's speed is the mean of its four
timings, two passes of two runs, which lie 0.6% apart at the median between passes and between runs):
SDPA picked cuDNN's kernel on every shape in both runs (what ``sdpa_kernel`` names on the H200); its forward +
backward ran 1.42-1.92x the flash backend's, the memory-efficient backend's 0.37-0.63x. Against the planner's
published figures (shares of the H100's peak, applied to the H200's, the same 989 TFLOP/s): FlashAttention-2's
(``flash2``) measured 0.82-1.00 of the planned speed (median 0.93), lowest at 8 heads of 128 (0.82-0.85 up to 4k
tokens); cuDNN's (``cudnn``, derived from Shah et al. 2024's H100 bars of a 2024 cuDNN) 0.87-1.19 (median 1.06):
0.91-1.11 at head dimension 64, 1.01-1.19 at 128 from 2k tokens on, where cuDNN 9.19 outruns the figures. plait's
own attention ran at 364 TFLOP/s under cuDNN, which ``cudnn`` costs at 392 (x0.93) and ``flash2`` at 265 (x1.38).
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("flash", "cudnn", "efficient")
# case batch seq heads kv_heads head_dim picked, then per backend (flash | cudnn | efficient) TFLOP/s of the
# forward in the two passes and of the forward + backward in the two passes; "-" where SDPA refused the backend
RUN_A_TEXT = """
    h1024 32   512 16 16  64 cudnn | 145.8 148.2 117.6 121.1 | 241.8 244.6 178.1 162.5 | 91.8 93.0 74.9 76.1
    h1024 16  1024 16 16  64 cudnn | 201.1 203.8 169.5 170.5 | 317.2 319.9 254.2 255.3 | 104.4 106.1 86.4 86.9
    h1024  8  2048 16 16  64 cudnn | 243.9 245.0 210.6 209.9 | 375.9 377.2 328.3 323.5 | 112.5 114.3 94.2 94.5
    h1024  4  4096 16 16  64 cudnn | 262.5 258.9 237.8 236.7 | 411.5 411.8 379.8 378.1 | 118.1 117.6 98.5 98.8
    h1024  2  8192 16 16  64 cudnn | 270.0 270.1 254.1 253.3 | 429.2 429.4 411.9 337.1 | 119.0 119.0 100.6 100.5
    h1024  1 16384 16 16  64 cudnn | 273.8 278.0 274.2 276.1 | 448.7 450.5 448.9 447.7 | 119.6 119.5 101.1 101.6
    h1024 32   512  8  8 128 cudnn | 166.7 168.8 134.6 133.4 | 308.9 300.0 216.3 132.1 | 110.3 111.8 82.8 82.6
    h1024 16  1024  8  8 128 cudnn | 220.7 220.6 183.7 184.0 | 417.4 417.7 318.7 317.6 | 130.1 131.9 100.3 101.4
    h1024  8  2048  8  8 128 cudnn | 252.5 249.1 221.3 218.0 | 484.3 487.3 396.8 386.0 | 141.5 142.9 113.3 113.6
    h1024  4  4096  8  8 128 cudnn | 269.0 267.3 249.7 250.0 | 535.8 532.5 473.1 469.7 | 147.1 148.0 118.9 120.8
    h1024  2  8192  8  8 128 cudnn | 281.3 280.4 268.8 271.4 | 570.4 568.8 516.6 516.6 | 149.4 153.6 125.8 127.4
    h1024  1 16384  8  8 128 cudnn | 282.9 290.9 299.5 300.9 | 587.5 588.5 579.8 579.2 | 152.8 147.8 131.0 131.8
    h2048 32   512 32 32  64 cudnn | 152.5 153.2 126.7 126.5 | 259.7 260.6 186.1 184.7 | 97.0 97.4 78.5 78.5
    h2048 16  1024 32 32  64 cudnn | 215.5 213.1 178.4 176.0 | 339.2 333.9 267.1 265.2 | 111.0 110.0 90.5 90.6
    h2048  8  2048 32 32  64 cudnn | 260.7 260.6 220.7 219.6 | 395.9 392.1 341.7 338.8 | 119.6 116.8 99.0 98.0
    h2048  4  4096 32 32  64 cudnn | 280.5 280.3 248.4 249.1 | 432.2 432.2 392.5 390.1 | 123.3 122.3 103.4 103.0
    h2048  2  8192 32 32  64 cudnn | 291.9 291.3 265.9 265.3 | 454.0 451.9 426.9 427.7 | 124.0 125.9 104.4 105.2
    h2048  1 16384 32 32  64 cudnn | 294.6 294.1 278.2 279.4 | 472.3 464.6 456.3 431.9 | 125.7 126.1 104.9 105.6
    h2048 32   512 16 16 128 cudnn | 186.6 184.7 145.3 144.8 | 353.8 350.0 230.8 238.8 | 118.4 113.1 87.8 85.2
    h2048 16  1024 16 16 128 cudnn | 247.9 244.4 199.5 198.5 | 456.5 454.1 298.3 344.4 | 138.7 139.1 106.9 106.8
    h2048  8  2048 16 16 128 cudnn | 282.2 280.2 243.5 242.9 | 537.0 533.9 443.0 425.8 | 143.8 145.0 114.0 117.4
    h2048  4  4096 16 16 128 cudnn | 302.5 305.6 270.3 273.7 | 589.1 586.5 507.0 507.6 | 158.6 146.1 127.9 126.5
    h2048  2  8192 16 16 128 cudnn | 315.5 315.9 291.1 293.9 | 619.8 618.1 519.0 542.7 | 149.4 151.5 133.5 135.1
    h2048  1 16384 16 16 128 cudnn | 316.7 316.7 312.6 313.9 | 635.8 629.4 547.4 589.7 | 158.8 157.0 137.1 138.3
    h4096 32   512 64 64  64 cudnn | 156.3 158.1 129.3 129.7 | 270.1 271.7 190.3 184.9 | 100.4 100.1 80.8 81.1
    h4096 16  1024 64 64  64 cudnn | 222.0 223.6 181.2 182.6 | 349.8 349.5 275.7 276.6 | 113.6 113.6 93.5 93.1
    h4096  8  2048 64 64  64 cudnn | 266.9 270.7 225.0 226.4 | 402.3 406.7 347.0 347.9 | 121.2 122.0 100.7 101.3
    h4096  4  4096 64 64  64 cudnn | 288.2 291.3 251.9 254.1 | 438.9 445.3 397.7 386.5 | 124.2 120.5 105.0 105.9
    h4096  2  8192 64 64  64 cudnn | 298.1 303.5 271.0 270.9 | 463.1 454.4 420.3 422.1 | 127.1 128.8 106.9 107.7
    h4096  1 16384 64 64  64 cudnn | 306.1 305.4 285.7 283.0 | 478.8 473.1 436.8 438.1 | 130.8 132.4 108.1 108.4
    h4096 32   512 32 32 128 cudnn | 194.9 193.3 148.9 149.2 | 371.8 372.0 249.6 250.4 | 122.3 122.3 90.6 88.6
    h4096 16  1024 32 32 128 cudnn | 264.7 263.9 207.4 208.2 | 480.0 477.8 360.9 363.8 | 135.5 135.6 105.5 107.3
    h4096  8  2048 32 32 128 cudnn | 301.5 304.1 250.8 253.7 | 553.7 555.8 438.3 443.2 | 148.0 146.2 121.9 122.5
    h4096  4  4096 32 32 128 cudnn | 319.9 323.2 282.1 281.9 | 606.7 608.4 525.8 527.6 | 148.1 164.4 132.1 132.7
    h4096  2  8192 32 32 128 cudnn | 334.4 332.6 301.6 302.5 | 640.3 641.9 511.2 545.1 | 158.5 158.6 137.7 137.8
    h4096  1 16384 32 32 128 cudnn | 341.9 327.2 318.4 318.1 | 656.6 650.4 541.9 541.6 | 167.6 166.4 141.1 140.8
    plait  4  2048 12  4 128 cudnn | 237.2 238.1 201.3 201.7 | 464.4 462.5 363.3 366.5 | - - - -
"""
RUN_B_TEXT = """
    h1024 32   512 16 16  64 cudnn | 145.6 147.6 121.5 122.5 | 241.9 245.3 174.7 177.2 | 92.1 92.6 75.1 75.4
    h1024 16  1024 16 16  64 cudnn | 202.1 202.3 167.9 170.4 | 318.0 320.9 254.7 255.3 | 104.4 105.2 86.4 87.0
    h1024  8  2048 16 16  64 cudnn | 244.7 242.8 211.6 210.0 | 376.5 373.7 319.7 327.1 | 111.8 112.3 93.1 93.5
    h1024  4  4096 16 16  64 cudnn | 263.1 260.6 236.4 236.1 | 411.7 411.0 375.6 375.8 | 116.5 116.8 97.9 98.1
    h1024  2  8192 16 16  64 cudnn | 269.4 273.1 254.3 253.9 | 433.9 433.5 411.5 412.4 | 119.1 119.6 100.4 100.4
    h1024  1 16384 16 16  64 cudnn | 271.7 281.1 269.8 274.1 | 448.8 449.1 439.8 443.2 | 119.9 116.5 101.8 101.8
    h1024 32   512  8  8 128 cudnn | 166.8 166.0 132.6 132.8 | 316.9 297.9 208.5 202.5 | 111.3 111.1 81.0 82.6
    h1024 16  1024  8  8 128 cudnn | 219.7 221.0 180.4 183.4 | 411.2 412.1 250.4 313.3 | 129.8 130.2 99.5 100.4
    h1024  8  2048  8  8 128 cudnn | 250.9 253.9 223.6 224.2 | 484.6 486.1 394.8 406.9 | 142.2 142.1 112.7 112.2
    h1024  4  4096  8  8 128 cudnn | 268.1 267.3 249.4 249.3 | 537.9 539.3 469.0 474.7 | 149.5 150.4 120.3 121.2
    h1024  2  8192  8  8 128 cudnn | 280.5 280.7 271.3 271.8 | 578.0 574.5 525.8 522.3 | 154.9 141.4 126.7 124.7
    h1024  1 16384  8  8 128 cudnn | 285.5 287.7 300.6 302.3 | 590.2 596.4 582.8 568.1 | 154.3 140.6 132.0 131.6
    h2048 32   512 32 32  64 cudnn | 153.9 153.9 127.6 127.4 | 262.1 261.9 180.3 184.1 | 97.1 97.5 78.5 78.9
    h2048 16  1024 32 32  64 cudnn | 216.1 215.0 178.6 178.0 | 339.1 338.1 265.1 268.0 | 109.5 111.0 89.9 90.7
    h2048  8  2048 32 32  64 cudnn | 257.1 260.6 217.6 220.1 | 391.1 393.4 339.6 341.5 | 118.2 117.8 98.8 97.7
    h2048  4  4096 32 32  64 cudnn | 278.0 280.3 247.8 247.3 | 424.9 430.7 390.5 392.1 | 123.6 123.6 102.7 103.0
    h2048  2  8192 32 32  64 cudnn | 285.1 290.0 265.0 265.9 | 447.0 451.6 426.9 429.6 | 126.8 126.8 105.2 105.3
    h2048  1 16384 32 32  64 cudnn | 291.3 295.4 281.2 279.9 | 460.2 466.4 436.3 444.0 | 120.9 125.2 105.7 105.6
    h2048 32   512 16 16 128 cudnn | 186.6 183.7 142.8 144.6 | 352.0 350.7 197.1 236.4 | 119.0 118.4 86.9 87.5
    h2048 16  1024 16 16 128 cudnn | 248.0 247.0 199.2 199.1 | 454.4 452.5 341.8 343.3 | 139.2 135.6 107.2 106.3
    h2048  8  2048 16 16 128 cudnn | 284.3 279.5 243.0 238.3 | 521.1 528.7 439.5 438.9 | 151.8 148.7 121.3 118.9
    h2048  4  4096 16 16 128 cudnn | 299.1 302.4 268.7 271.3 | 579.5 582.2 503.4 488.6 | 148.6 150.7 121.9 127.0
    h2048  2  8192 16 16 128 cudnn | 306.5 310.9 288.4 292.5 | 610.6 612.5 549.4 511.4 | 152.9 147.1 134.6 134.1
    h2048  1 16384 16 16 128 cudnn | 319.7 318.4 311.8 313.5 | 632.1 623.4 604.4 544.6 | 153.7 145.6 138.0 138.0
    h4096 32   512 64 64  64 cudnn | 157.0 157.0 129.5 129.2 | 270.3 270.2 187.0 188.4 | 99.8 99.9 80.1 80.0
    h4096 16  1024 64 64  64 cudnn | 221.9 220.9 181.6 180.3 | 347.3 345.8 274.9 273.1 | 113.3 113.3 93.5 92.7
    h4096  8  2048 64 64  64 cudnn | 269.5 266.9 225.4 225.0 | 400.0 400.5 347.7 346.4 | 119.4 120.4 101.2 101.0
    h4096  4  4096 64 64  64 cudnn | 285.7 286.7 253.0 253.0 | 435.9 431.8 390.8 395.8 | 120.4 124.6 105.7 105.6
    h4096  2  8192 64 64  64 cudnn | 301.2 303.2 273.4 273.3 | 459.2 456.6 412.4 434.5 | 127.6 125.6 107.6 107.7
    h4096  1 16384 64 64  64 cudnn | 307.7 301.5 283.4 282.8 | 471.0 471.6 438.4 435.0 | 132.2 130.4 107.6 108.2
    h4096 32   512 32 32 128 cudnn | 194.1 192.7 149.5 147.7 | 368.4 368.2 246.0 246.3 | 119.5 120.3 88.4 89.8
    h4096 16  1024 32 32 128 cudnn | 262.6 257.7 206.8 206.7 | 474.2 473.8 356.1 359.4 | 136.0 134.2 107.6 105.0
    h4096  8  2048 32 32 128 cudnn | 300.5 300.7 252.5 252.4 | 554.8 554.2 455.3 455.5 | 143.1 143.5 121.4 120.8
    h4096  4  4096 32 32 128 cudnn | 320.7 322.4 283.9 284.1 | 596.9 598.0 520.8 499.8 | 161.6 145.0 132.4 133.2
    h4096  2  8192 32 32 128 cudnn | 333.8 329.7 305.0 304.6 | 630.4 629.1 524.2 511.6 | 156.3 154.4 138.7 138.9
    h4096  1 16384 32 32 128 cudnn | 342.2 330.9 320.7 320.5 | 651.7 649.8 535.1 540.7 | 168.8 168.0 141.6 141.7
    plait  4  2048 12  4 128 cudnn | 234.9 237.9 200.3 201.0 | 460.8 464.0 361.7 366.3 | - - - -
"""

@dataclass(frozen=True)
class Measured:
    """One shape of one run: ``tflops[backend]`` is ((forward, forward), (forward + backward, forward + backward)),
    the two passes; None where SDPA refused the backend."""

    case: str
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    picked: str
    tflops: dict[str, tuple[tuple[float, float], tuple[float, float]] | None]


def _parse(text: str) -> tuple[Measured, ...]:
    out = []
    for line in text.strip().splitlines():
        shape, *cells = line.split("|")
        case, *sizes, picked = shape.split()
        tflops: dict[str, tuple[tuple[float, float], tuple[float, float]] | None] = {}
        for backend, cell in zip(BACKENDS, cells, strict=True):
            v = cell.split()
            tflops[backend] = None if v[0] == "-" else ((float(v[0]), float(v[1])), (float(v[2]), float(v[3])))
        b, s, h, kv, d = (int(x) for x in sizes)
        out.append(Measured(case, b, s, h, kv, d, picked, tflops))
    return tuple(out)


RUN_A: tuple[Measured, ...] = _parse(RUN_A_TEXT)
RUN_B: tuple[Measured, ...] = _parse(RUN_B_TEXT)
