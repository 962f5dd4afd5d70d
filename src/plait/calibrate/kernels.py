"""Kernel timings of one process: GEMMs, causal attention, the element-wise mix of a Llama block, streaming.

Each function returns the rate one call of this process reaches, in the units ``plait.plan.profile``
documents. They are called either with the other processes waiting (``alone``) or with every process
running the same function at once (``shared``). Work sizes are kept small so that every figure takes
tens of milliseconds: the whole calibration takes about a minute.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from plait.plan import eager
from plait.plan.model import llama_ffn

# (tokens, out, in) of linear layers from 1 MFLOP to 1.2 GFLOP a call: small calls pay dispatch and
# autograd, large ones run at the cores' speed
GEMM_SHAPES = ((128, 64, 64), (256, 128, 128), (512, 128, 256), (512, 256, 512), (512, 688, 256),
               (1024, 512, 512), (1024, 768, 768))
ATTENTION_SHAPES = ((64, 32), (128, 32), (256, 32), (256, 64), (512, 64))  # (sequence, head size)
ATTENTION_TOKENS = 1024  # batch · sequence per call
ELEMENT_SIZES = (1 << 12, 1 << 15, 1 << 17, 1 << 19)  # elements of the hidden state [T, h]
TINY = (2, 4, 8)  # [B, S, h] for the fixed cost of a kernel
REFERENCE_SHAPE = GEMM_SHAPES[3]  # the host-speed probe (``reference_rate``)
BUDGET_S = 0.06  # time each figure is measured for (after a warm-up call)
BLOCK_BUDGET_S = 0.6  # a decoder layer's rest is a small difference of two larger times: it needs more repeats
OPTIMIZER_STATE_BYTES = 2**27  # the optimizer step is timed over parameters whose p, grad, m, v outgrow this
OPTIMIZER_SMALL_TENSORS = (256, 1024)  # (tensors, elements each) of the set that times its fixed cost per tensor


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (a no-op on the CPU, where kernels run as they are called)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, budget: float = BUDGET_S, stat: str = "median") -> float:
    """Seconds of ``fn`` over about ``budget`` seconds of repeats (two warm-up calls first): their ``median``
    (one process alone: robust to a stray interruption), or their ``mean`` (processes sharing the cores: the
    time-slicing scheduler runs a short call uninterrupted and stops another for a whole slice, so the
    median would show the speed of a process running alone, the mean is what a run gets)."""
    fn()
    fn()
    sync(device)
    times: list[float] = []
    spent = 0.0
    while spent < budget or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        sync(device)
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    if stat == "mean":
        return spent / len(times)
    times.sort()
    return times[len(times) // 2]


def gemm_flops(shape: tuple[int, int, int]) -> float:
    """Forward FLOPs of a linear layer of (tokens, out, in): what the rate is keyed by."""
    t, n, k = shape
    return 2.0 * t * n * k


def gemm_rate(shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype, stat: str = "median") -> float:
    """FLOP/s of a linear layer's forward and backward, x [T, in] · w [out, in]ᵀ (3 · 2·T·out·in FLOPs)."""
    t, n, k = shape
    x = torch.randn(t, k, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(t, n, device=device, dtype=dtype)

    def step() -> None:
        F.linear(x, w).backward(g)

    return 3 * gemm_flops(shape) / timed(step, device, stat=stat)


def reference_rate(device: torch.device) -> float:
    """The host's speed now: FLOP/s of the ``REFERENCE_SHAPE`` linear layer's forward and backward on one
    thread (the median of its calls). Taken the same way every time (one process, one thread, the others
    idle), it compares the host with itself at another moment: a virtual machine's neighbours move every
    kernel's speed together, over seconds to minutes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return gemm_rate(REFERENCE_SHAPE, device, torch.float32)
    finally:
        torch.set_num_threads(threads)


def attention_rate(seq: int, head: int, device: torch.device, dtype: torch.dtype,
                   stat: str = "median") -> tuple[float, float]:
    """(FLOP/s, forward share) of causal SDPA forward + backward, FLOPs counted as 4·s²·d per head and
    sequence (non-causal, the planner's count)."""
    batch = max(1, ATTENTION_TOKENS // seq)
    heads = 4
    q, k, v = (torch.randn(batch, heads, seq, head, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    g = torch.randn(batch, heads, seq, head, device=device, dtype=dtype)

    def fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    both = timed(lambda: fwd().backward(g), device, stat=stat)
    with torch.no_grad():
        forward = timed(fwd, device, stat=stat)
    flops = 4 * batch * heads * seq * seq * head
    return flops / both, min(forward / both, 1.0)


class _Mix:
    """The element-wise kernels of a Llama block on a [B, S, h] hidden state, as ``plan.eager`` counts them:
    an RMSNorm, RoPE on a head-major view, SwiGLU's silu·up, a residual add, the heads' transpose copy."""

    def __init__(self, b: int, s: int, h: int, device: torch.device, dtype: torch.dtype):
        heads = max(1, h // 32)
        self.shape = (b, s, heads, h // heads)
        self.x = torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True)
        self.w = torch.ones(h, device=device, dtype=dtype, requires_grad=True)
        self.cos = torch.randn(s, h // heads, device=device, dtype=dtype)
        self.sin = torch.randn(s, h // heads, device=device, dtype=dtype)
        self.n = b * s * h

    def forward(self) -> torch.Tensor:
        x = self.x
        y = self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))  # RMSNorm
        q = y.view(self.shape).transpose(1, 2)  # [B, H, S, d], a strided view as in attention
        x1, x2 = q.chunk(2, dim=-1)
        r = q * self.cos + torch.cat((-x2, x1), dim=-1) * self.sin  # RoPE
        r = r.transpose(1, 2).reshape(x.shape)  # the heads' transpose copy
        return x + F.silu(r) * y  # SwiGLU's silu(gate) · up, the residual add

    @property
    def traffic(self) -> float:
        """Elements moved by one forward, counted as ``plan.eager`` counts a layer's."""
        return (eager.NORM_TRAFFIC + eager.ROPE_TRAFFIC + eager.GLU_TRAFFIC + eager.RESIDUAL_TRAFFIC + 2) * self.n

    @property
    def ops(self) -> float:
        return (eager.NORM_OPS + eager.ROPE_OPS + eager.GLU_OPS + eager.RESIDUAL_OPS + 1
                + 4 * eager.VIEW_OPS)


def op_overhead(device: torch.device, dtype: torch.dtype, stat: str = "median") -> float:
    """Seconds of one small kernel forward plus its backward (dispatch, autograd), from the mix on a tiny
    tensor."""
    mix = _Mix(*TINY, device, dtype)
    return timed(lambda: mix.forward().sum().backward(), device, stat=stat) / mix.ops


def elementwise_rate(elements: int, overhead: float, device: torch.device,
                     dtype: torch.dtype, stat: str = "median") -> tuple[float, float, float]:
    """(bytes per kernel, forward + backward bytes/s per forward byte counted, forward share) of the mix
    on a hidden state of ``elements``, its fixed kernel costs taken off."""
    h = 256 if elements >= 1 << 15 else 64
    s = 64
    mix = _Mix(max(1, elements // (s * h)), s, h, device, dtype)
    g = torch.ones_like(mix.x)
    both = timed(lambda: mix.forward().backward(g), device, stat=stat)
    with torch.no_grad():
        forward = timed(mix.forward, device, stat=stat)
    nbytes = mix.traffic * mix.x.element_size()
    work = max(both - mix.ops * overhead, 0.1 * both)
    return nbytes / mix.ops, nbytes / work, min(forward / both, 1.0)


def stream_bandwidth(device: torch.device, stat: str = "median") -> float:
    """Bytes/s of copying a 32 MB fp32 array (read + write), larger than a CPU's caches."""
    src = torch.randn(8 << 20, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), device, stat=stat)


def _block(shape: tuple[int, int, int, int, int], device: torch.device, dtype: torch.dtype):
    """Calibration block ``shape`` (``plan.eager.CALIBRATION_BLOCKS``): plait's Llama decoder layer and an input."""
    from plait.models.llama import DecoderLayer, LlamaConfig

    b, s, h, heads, kv = shape
    cfg = LlamaConfig(dim=h, n_layers=1, n_heads=heads, n_kv_heads=kv, ffn_dim=llama_ffn(h), max_seq_len=s)
    layer = DecoderLayer(cfg).to(device=device, dtype=dtype)
    x = torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True)  # [B, S, h]
    return layer, x


def _skeleton(shape: tuple[int, int, int, int, int], device: torch.device,
              dtype: torch.dtype) -> tuple[Callable[[], list[torch.Tensor]], Callable[[list[torch.Tensor]], None]]:
    """The GEMMs and attention of calibration block ``shape`` alone: its seven linear layers on [T, in] inputs
    and causal SDPA on contiguous [B, heads, S, d] (K and V already repeated). Returns (forward, backward):
    ``forward()`` runs them with autograd recording and returns their outputs, ``backward(outputs)`` runs
    each one's backward."""
    b, s, h, heads, _ = shape
    d, f, t = h // heads, llama_ffn(h), b * s
    kv = h // heads * shape[4]
    dims = ((h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f))  # (out, in): q, k, v, o, gate, up, down
    xs = {k: torch.randn(t, k, device=device, dtype=dtype, requires_grad=True) for k in (h, f)}
    ws = [torch.randn(o, i, device=device, dtype=dtype, requires_grad=True) for o, i in dims]
    gs = [torch.randn(t, o, device=device, dtype=dtype) for o, _ in dims]
    q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    gs.append(torch.randn(b, heads, s, d, device=device, dtype=dtype))

    def forward() -> list[torch.Tensor]:
        return [F.linear(xs[w.shape[1]], w) for w in ws] + [F.scaled_dot_product_attention(q, k, v, is_causal=True)]

    def backward(outs: list[torch.Tensor]) -> None:
        for out, g in zip(outs, gs, strict=True):
            out.backward(g)

    return forward, backward


def block_time(shape: tuple[int, int, int, int, int], device: torch.device,
               dtype: torch.dtype, stat: str = "median") -> tuple[float, float, float]:
    """(hidden-state elements, seconds, forward share) of a real decoder layer's forward + backward beyond its
    GEMMs and attention (its "rest": norms, RoPE, activations, residuals, reshapes, autograd's bookkeeping),
    and the share of that rest spent in the forward: the layer and its kernel skeleton (``_skeleton``) timed
    in alternation, forward and backward apart, so that both see the same machine; the forward records
    autograd's graph as a training step's does; the parameters' gradients accumulate as over a step's
    micro-batches."""
    layer, x = _block(shape, device, dtype)
    g = torch.randn_like(x)
    skeleton, skeleton_backward = _skeleton(shape, device, dtype)
    whole: list[tuple[float, float]] = []  # (forward, forward + backward) seconds
    bare: list[tuple[float, float]] = []

    def layer_forward() -> list[torch.Tensor]:
        return [layer(x)]

    def layer_backward(outs: list[torch.Tensor]) -> None:
        outs[0].backward(g)

    for _ in range(2):  # warm-up
        layer_backward(layer_forward())
        skeleton_backward(skeleton())
    spent = 0.0
    while spent < BLOCK_BUDGET_S or len(whole) < 5:
        for forward, backward, out in ((layer_forward, layer_backward, whole), (skeleton, skeleton_backward, bare)):
            t0 = time.perf_counter()
            outs = forward()
            sync(device)
            t1 = time.perf_counter()
            backward(outs)
            sync(device)
            t2 = time.perf_counter()
            out.append((t1 - t0, t2 - t0))
            spent += t2 - t0
    # the rest is a difference of two close times: taken pair by pair (each pair sees the same machine), the
    # median of the pairs alone, their mean when every process is measuring at once (see ``timed``)
    pick = statistics.mean if stat == "mean" else statistics.median
    rest = pick([a[1] - b[1] for a, b in zip(whole, bare, strict=True)])
    rest_forward = pick([a[0] - b[0] for a, b in zip(whole, bare, strict=True)])
    share = min(max(rest_forward / rest, 0.0), 1.0) if rest > 0 else 1 / 3
    return float(x.numel()), max(rest, 0.0), share


def optimizer_times(device: torch.device) -> tuple[float, float]:
    """(seconds per parameter, seconds per parameter tensor) of plait's optimizer step
    (``plait.optim.build_optimizer``: the global norm in float64 a tensor at a time, the clip's scale,
    torch's AdamW, fused where the device has it), fp32 as the planner's eager optimizer is costed.

    Timed over two sets and solved for both figures (t = a·parameters + b·tensors): copies of the larger
    calibration block's parameters until their state outgrows ``OPTIMIZER_STATE_BYTES`` (a model's state
    does not stay in the cache between steps; one copy's 25 MB did on a 32 MB L3, and ran 1.2-1.7 times as
    fast per parameter), and ``OPTIMIZER_SMALL_TENSORS`` small tensors, where each tensor's kernels' fixed
    costs dominate (about 30 µs a tensor on a 2-core CPU: a quarter of ``small``'s optimizer step)."""
    block = eager.CALIBRATION_BLOCKS[-1]
    big: list[torch.Tensor] = []
    while 16 * sum(p.numel() for p in big) < OPTIMIZER_STATE_BYTES:
        layer, x = _block(block, device, torch.float32)
        layer(x).sum().backward()
        big += [p for p in layer.parameters() if p.grad is not None]
    count, size = OPTIMIZER_SMALL_TENSORS
    small: list[torch.Tensor] = [torch.nn.Parameter(torch.randn(size, device=device)) for _ in range(count)]
    for p in small:
        p.grad = torch.randn(size, device=device)
    (t_big, p_big, n_big), (t_small, p_small, n_small) = (_optimizer_step_time(ps, device) for ps in (big, small))
    per_tensor = (t_small * p_big - t_big * p_small) / (n_small * p_big - n_big * p_small)
    per_tensor = min(max(per_tensor, 0.0), t_big / n_big)  # noise can push the solution past either bound
    return (t_big - per_tensor * n_big) / p_big, per_tensor


def _optimizer_step_time(params: list[torch.Tensor], device: torch.device) -> tuple[float, int, int]:
    """(seconds, parameters, tensors) of plait's optimizer step over ``params`` (their ``.grad`` set)."""
    from plait.optim.optimizer import FUSED_ADAMW_DEVICES, square_sum

    opt = torch.optim.AdamW(params, lr=1e-4, fused=True if device.type in FUSED_ADAMW_DEVICES else None)
    grads = [p.grad for p in params if p.grad is not None]

    @torch.no_grad()
    def step() -> None:
        norm = torch.stack([square_sum(q) for q in grads]).sum().sqrt()
        torch._foreach_mul_(grads, float(1.0 / (norm + 1e-6)))
        opt.step()

    return timed(step, device), sum(p.numel() for p in params), len(params)
