"""Kernel timings of one process: GEMMs, causal attention, the element-wise mix of a Llama block, streaming.

Each figure is a ``Kernel``: the calls to time, and how their seconds make the rate one call of this
process reaches, in the units ``plait.plan.host.profile`` documents. ``measure_alone`` times one with the other
processes waiting; ``plait.calibrate.run`` also times each with every process at it at once, in
alternation with the same calls alone. Work sizes are kept small so that every figure takes tens of
milliseconds: the whole calibration takes about a minute.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from plait.devices import synchronize
from plait.models.rotary import rotate
from plait.plan.host import census, shapes
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
BLOCK_BUDGET_S = 0.9  # a decoder layer's rest is a small difference of two larger times: it needs more repeats
# (the budget covers the layer, its skeleton and the layer recomputing its attention core: 0.3 s each)
OPTIMIZER_STATE_BYTES = 2**27  # the optimizer step is timed over parameters whose p, grad, m, v outgrow this
OPTIMIZER_SMALL_TENSORS = (256, 1024)  # (tensors, elements each) of the set that times its fixed cost per tensor


Rounds = list[dict[str, float]]  # each round: every call of a kernel timed once (seconds), and the parts it reports
Pick = Callable[[list[float]], float]  # how a figure reduces its rounds: statistics.median or statistics.mean
Call = Callable[[], "dict[str, float] | None"]  # one call; it may report the seconds of named parts of itself


@dataclass(frozen=True)
class Kernel:
    """One figure to measure: ``calls`` (name -> one call, timed whole; a call may return the seconds of named
    parts of itself, recorded beside it) and ``figure``, which makes the figure from rounds of their seconds
    reduced by a ``Pick``. ``budget``: seconds of calls one process alone spends on it."""

    label: str
    calls: dict[str, Call]
    figure: Callable[[Rounds, Pick], tuple[float, ...]]
    budget: float = BUDGET_S


def _seconds(rounds: Rounds, name: str) -> list[float]:
    return [r[name] for r in rounds]


def warm_up(kernel: Kernel, device: torch.device, rounds: int = 2) -> None:
    """``rounds`` rounds of ``kernel``'s calls, untimed (first calls allocate and pick their kernels)."""
    for _ in range(rounds):
        for call in kernel.calls.values():
            call()
    synchronize(device)


def time_rounds(kernel: Kernel, device: torch.device, budget: float, least: int) -> Rounds:
    """Rounds of ``kernel``'s calls, each call timed once per round in turn (so that a difference of two calls
    is taken within a round, on the same machine), until ``budget`` seconds are spent and at least ``least``
    rounds are done."""
    out: Rounds = []
    spent = 0.0
    while spent < budget or len(out) < least:
        one: dict[str, float] = {}
        for name, call in kernel.calls.items():
            t0 = time.perf_counter()
            parts = call()
            synchronize(device)
            one[name] = time.perf_counter() - t0
            one.update(parts or {})
        out.append(one)
        spent += sum(one[name] for name in kernel.calls)
    return out


def measure_alone(kernel: Kernel, device: torch.device) -> tuple[float, ...]:
    """``kernel``'s figure for one process alone: the median of its rounds over its budget (robust to a stray
    interruption)."""
    warm_up(kernel, device)
    return kernel.figure(time_rounds(kernel, device, kernel.budget, 3), statistics.median)


def timed(fn: Callable[[], object], device: torch.device, budget: float = BUDGET_S) -> float:
    """Seconds of ``fn``: the median of its calls over about ``budget`` seconds (after two warm-up calls)."""
    def call() -> None:
        fn()

    return measure_alone(Kernel("", {"call": call}, lambda r, pick: (pick(_seconds(r, "call")),), budget), device)[0]


def gemm_flops(shape: tuple[int, int, int]) -> float:
    """Forward FLOPs of a linear layer of (tokens, out, in): what the rate is keyed by."""
    t, n, k = shape
    return 2.0 * t * n * k


def gemm(shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype) -> Kernel:
    """(forward FLOPs, FLOP/s, forward share 1/3) of a linear layer's forward and backward, x [T, in] ·
    w [out, in]ᵀ (3 · 2·T·out·in FLOPs)."""
    t, n, k = shape
    x = torch.randn(t, k, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(t, n, device=device, dtype=dtype)
    flops = gemm_flops(shape)

    def step() -> None:
        F.linear(x, w).backward(g)

    return Kernel(f"matmul {t}x{n}x{k}", {"step": step},
                  lambda r, pick: (flops, 3 * flops / pick(_seconds(r, "step")), 1 / 3))


def reference_rate(device: torch.device) -> float:
    """The host's speed now: FLOP/s of the ``REFERENCE_SHAPE`` linear layer's forward and backward on one
    thread (the median of its calls). Taken the same way every time (one process, one thread, the others
    idle), it compares the host with itself at another moment: a virtual machine's neighbours move every
    kernel's speed together, over seconds to minutes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_alone(gemm(REFERENCE_SHAPE, device, torch.float32), device)[1]
    finally:
        torch.set_num_threads(threads)


def attention(seq: int, head: int, device: torch.device, dtype: torch.dtype) -> Kernel:
    """(s·d, FLOP/s, forward share) of causal SDPA forward + backward, FLOPs counted as 4·s²·d per head and
    sequence (non-causal, the planner's count)."""
    batch = max(1, ATTENTION_TOKENS // seq)
    heads = 4
    q, k, v = (torch.randn(batch, heads, seq, head, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    g = torch.randn(batch, heads, seq, head, device=device, dtype=dtype)
    flops = 4 * batch * heads * seq * seq * head

    def both() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    @torch.no_grad()
    def forward() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def figure(r: Rounds, pick: Pick) -> tuple[float, ...]:
        t = pick(_seconds(r, "both"))
        return float(seq * head), flops / t, min(pick(_seconds(r, "forward")) / t, 1.0)

    return Kernel(f"attention s={seq} d={head}", {"both": both, "forward": forward}, figure, 2 * BUDGET_S)


class _Mix:
    """The element-wise kernels of a Llama block on a [B, S, h] hidden state, as ``plan.host.census`` counts them:
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
        y = self.w * F.rms_norm(x, (x.shape[-1],), eps=1e-5)  # RMSNorm
        q = y.view(self.shape).transpose(1, 2)  # [B, H, S, d], a strided view as in attention
        r = rotate(q, self.cos, self.sin)  # RoPE
        r = r.transpose(1, 2).reshape(x.shape)  # the heads' transpose copy
        return x + F.silu(r) * y  # SwiGLU's silu(gate) · up, the residual add

    def tiny_step(self) -> None:
        self.forward().sum().backward()

    @property
    def traffic(self) -> float:
        """Elements moved by one forward, counted as ``plan.host.census`` counts a layer's."""
        return (census.NORM_TRAFFIC + census.ROPE_TRAFFIC + census.GLU_TRAFFIC + census.RESIDUAL_TRAFFIC + 2) * self.n

    @property
    def ops(self) -> float:
        return (census.NORM_OPS + census.ROPE_OPS + census.GLU_OPS + census.RESIDUAL_OPS + 1
                + 4 * census.VIEW_OPS)


def op_overhead(device: torch.device, dtype: torch.dtype) -> Kernel:
    """(seconds,) of one small kernel forward plus its backward (dispatch, autograd), from the mix on a tiny
    tensor."""
    mix = _Mix(*TINY, device, dtype)
    return Kernel("kernel overhead", {"tiny": mix.tiny_step}, lambda r, pick: (pick(_seconds(r, "tiny")) / mix.ops,))


def elementwise(elements: int, device: torch.device, dtype: torch.dtype) -> Kernel:
    """(bytes per kernel, forward + backward bytes/s per forward byte counted, forward share) of the mix on a
    hidden state of ``elements``, its fixed kernel costs (the mix on a tiny tensor, timed in the same rounds)
    taken off."""
    h = 256 if elements >= 1 << 15 else 64
    s = 64
    mix = _Mix(max(1, elements // (s * h)), s, h, device, dtype)
    tiny = _Mix(*TINY, device, dtype)
    g = torch.ones_like(mix.x)
    nbytes = mix.traffic * mix.x.element_size()

    def both() -> None:
        mix.forward().backward(g)

    @torch.no_grad()
    def forward() -> None:
        mix.forward()

    def figure(r: Rounds, pick: Pick) -> tuple[float, ...]:
        t = pick(_seconds(r, "both"))
        work = max(t - mix.ops * pick(_seconds(r, "tiny")) / tiny.ops, 0.1 * t)
        return nbytes / mix.ops, nbytes / work, min(pick(_seconds(r, "forward")) / t, 1.0)

    return Kernel(f"element-wise mix, {elements} elements", {"both": both, "forward": forward,
                                                           "tiny": tiny.tiny_step}, figure, 2 * BUDGET_S)


def stream(device: torch.device) -> Kernel:
    """(bytes/s,) of copying a 32 MB fp32 array (read + write), larger than a CPU's caches."""
    src = torch.randn(8 << 20, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    nbytes = 2 * src.numel() * src.element_size()
    return Kernel("memory bandwidth", {"copy": copy}, lambda r, pick: (nbytes / pick(_seconds(r, "copy")),))


def decoder_layer(shape: tuple[int, int, int, int, int], device: torch.device, dtype: torch.dtype):
    """Calibration block ``shape`` (``plan.shapes.CALIBRATION_BLOCKS``): plait's Llama decoder layer and an input."""
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


def block(shape: tuple[int, int, int, int, int], device: torch.device, dtype: torch.dtype) -> Kernel:
    """(hidden-state elements, seconds, forward share, layer seconds, layer forward share, recomputed core
    seconds) of a real decoder layer: its forward + backward beyond its GEMMs and attention (its "rest":
    norms, RoPE, activations, residuals, reshapes, autograd's bookkeeping) and the share of that rest spent
    in the forward; then the whole layer's seconds and its forward's share of them; then what recomputing
    its attention core in the backward, as ``recompute="selective"`` runs it (``plait.recompute``: the core
    under a checkpoint), adds to the whole layer. The layer, its kernel skeleton (``_skeleton``) and the
    recomputing layer are timed in alternation, the first two reporting their forward apart, so that all see
    the same machine; the forward records autograd's graph as a training step's does; the parameters'
    gradients accumulate as over a step's micro-batches. The rest and the recomputation are differences of
    close times: each is taken round by round (each round sees the same machine) and then reduced."""
    from plait.recompute import recompute_attention

    layer, x = decoder_layer(shape, device, dtype)
    g = torch.randn_like(x)
    recomputing = copy.deepcopy(layer)
    recompute_attention({"self_attn": recomputing.self_attn}, "the calibration layer")
    skeleton_forward, skeleton_backward = _skeleton(shape, device, dtype)

    def timed_in_two(forward: Callable[[], list[torch.Tensor]], backward: Callable[[list[torch.Tensor]], None],
                     name: str) -> Call:
        def call() -> dict[str, float]:
            t0 = time.perf_counter()
            outs = forward()
            synchronize(device)
            seconds = time.perf_counter() - t0
            backward(outs)
            return {name: seconds}
        return call

    def figure(r: Rounds, pick: Pick) -> tuple[float, ...]:
        rest = pick([a - b for a, b in zip(_seconds(r, "layer"), _seconds(r, "skeleton"), strict=True)])
        rest_forward = pick([a - b for a, b in zip(_seconds(r, "layer forward"), _seconds(r, "skeleton forward"),
                                                   strict=True)])
        share = min(max(rest_forward / rest, 0.0), 1.0) if rest > 0 else 1 / 3
        whole = pick(_seconds(r, "layer"))
        redone = pick([a - b for a, b in zip(_seconds(r, "selective"), _seconds(r, "layer"), strict=True)])
        return (float(x.numel()), max(rest, 0.0), share, whole, min(pick(_seconds(r, "layer forward")) / whole, 1.0),
                max(redone, 0.0))

    def selective() -> None:
        recomputing(x).backward(g)

    calls = {"layer": timed_in_two(lambda: [layer(x)], lambda outs: outs[0].backward(g), "layer forward"),
             "skeleton": timed_in_two(skeleton_forward, skeleton_backward, "skeleton forward"),
             "selective": selective}
    return Kernel(f"decoder layer {'x'.join(map(str, shape[:3]))}", calls, figure, BLOCK_BUDGET_S)


def optimizer_times(device: torch.device) -> tuple[float, float]:
    """(seconds per parameter, seconds per parameter tensor) of plait's optimizer step
    (``plait.optim.build_optimizer``: the global norm in float64 a tensor at a time, the clip's scale,
    torch's AdamW, fused where the device has it), fp32 as the planner's eager optimizer is costed.

    Timed over two sets and solved for both figures (t = a·parameters + b·tensors): copies of the larger
    calibration block's parameters until their state outgrows ``OPTIMIZER_STATE_BYTES`` (a model's state
    does not stay in the cache between steps, and a state that fits the cache runs faster per parameter),
    and ``OPTIMIZER_SMALL_TENSORS`` small tensors, where each tensor's kernels' fixed costs dominate
    (docs/planner-log.md, entry 12)."""
    block = shapes.CALIBRATION_BLOCKS[-1]
    big: list[torch.Tensor] = []
    while 16 * sum(p.numel() for p in big) < OPTIMIZER_STATE_BYTES:
        layer, x = decoder_layer(block, device, torch.float32)
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
        norm = square_sum(grads).sqrt()  # as grad_norm
        torch._foreach_mul_(grads, float(1.0 / (norm + 1e-6)))
        opt.step()

    return timed(step, device), sum(p.numel() for p in params), len(params)
