"""plait's own element-wise kernels on a GPU: each kernel one eager training step of the Llama family launches per
layer, for its head and loss, and once a step, counted from plait's code, with the HBM bytes it reads and writes.

The GPU model's fitted element-wise term (``GPU.elementwise_traffic`` times a layer's stored activation bytes) was
fitted on published Megatron-style stacks, whose norms, activations and residual adds run fused. plait's runtime
runs them eagerly: every operator of ``plait.models.llama`` below is its own kernel that reads its inputs from HBM
and writes its output there, and the backward of each is one or two more. ``Training(elementwise="plait-eager")``
costs a layer's and the head's element-wise kernels with this count instead (``GpuCosts.blocks``): each kernel's
bytes at the speed its GPU runs its kind (``Kernel.kind``) where that was measured (``catalogue.KernelRates``: the
H200's), else at the GPU's datasheet memory bandwidth; nothing fitted. The once-a-step kernels (``step_kernels``)
are counted, not charged. How the count and its time compare with a profiled step: ``tests/test_plan_eager.py``,
``tests/test_plan_own_gpu.py`` and docs/planner.md.

Each kernel counts what it reads and writes once, as ``plan.optimizers`` counts: a binary op on two [T, n] tensors
reads both and writes one (3 element sizes); an op with a small broadcast operand (RoPE's [S, hd] tables, a norm's
[h] weight) reads the large one only; a cast reads one size and writes the other. Element sizes: ``a`` for the
compute dtype (bf16: 2, fp32: 4), 4 for the norms' float32 arithmetic. Tensors of one token or one row (a norm's
rstd, the loss's maxima and sums) are left out: under 1/h of their kernel's bytes.

Shapes for one micro-batch on one GPU: T = micro-batch size · S/cp tokens; the norms and residuals run over the
T/t tokens sequence parallelism leaves a rank (all T without it) of width h; q = heads/t · hd and kv = max(kv
heads/t, 1) · hd are the query and key widths, f = ffn/t the MLP's, V/t the logits'. A mixture-of-experts layer's
SwiGLU runs over the T·top_k routed tokens, on the busiest GPU of an EP group ``plan.experts.received`` times
that (its router and dispatch kernels are not counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.plan import experts

if TYPE_CHECKING:
    from plait.plan.catalogue import KernelRates
    from plait.plan.config import Layout
    from plait.plan.model import Model

#: how a costed stack runs its element-wise kernels (``Training.elementwise``): "fused", the GPU model's fitted term
#: (published Megatron-style stacks), or "plait-eager", plait's own eager kernels counted here
ELEMENTWISE = ("fused", "plait-eager")
#: plait's runtime's
RUNTIME_ELEMENTWISE = "plait-eager"
#: the kinds of element-wise kernel ``bench/gpu_check.py``'s elementwise section times alone (its cases' names):
#: SwiGLU's product of two [T, f] tensors, a residual sum of two [T, h], the norm's cast to float32 and its
#: ``rms_norm``, a norm weight's broadcast product, RoPE's table product on the transposed q, the copy of that
#: transpose, ``roll``, and the sum of two tensors of different layouts
KINDS = ("mul_contiguous", "add_contiguous", "cast_to_fp32", "rms_norm_fp32", "mul_norm_weight", "mul_rope_table",
         "copy_transpose", "roll", "add_mixed_layouts")


@dataclass(frozen=True)
class Kernel:
    """``calls`` launches of one operator in one pass and the HBM bytes they read and write together."""

    op: str
    """The aten operator the torch profiler names them by (``aten::mul`` is "mul")."""
    phase: str
    """"forward" or "backward"."""
    calls: int
    nbytes: float
    strided: bool = False
    """An operand broadcast ([S, hd] tables, an [h] weight) or laid out unlike the output: torch's CUDA loops
    (aten/src/ATen/native/cuda/CUDALoops.cuh, ``gpu_kernel_impl``) then run the generic ``elementwise_kernel``,
    which computes every operand's offset from the element's index, instead of the vectorized kernel they run on
    contiguous operands of one dtype (casts run the unrolled one)."""
    kind: str = ""
    """Which of ``KINDS`` it is, where it is one; "" for a kernel of no measured kind (reductions, ``silu``, the
    norm's backward, the casts down to bf16, the loss's float32 kernels)."""


def dtype_bytes(precision: str) -> int:
    """Bytes of an activation element under ``precision``."""
    return 2 if precision == "bf16" else 4


def rms_norm(n: float, a: int) -> list[Kernel]:
    """One ``RMSNorm`` over ``n`` elements (plait/models/llama.py ``RMSNorm.forward``: ``weight *
    F.rms_norm(x.float(), ...).to(x.dtype)``) and its backward; ``a`` the bytes of x's dtype. The casts are no-ops
    (no kernel) when x is float32. ``F.rms_norm`` is one fused kernel each way on a GPU."""
    cast = a != 4
    up = "cast_to_fp32"
    out = [Kernel("copy_", "forward", 1, (a + 4) * n, kind=up)] if cast else []  # x.float(): [T, h] a -> 4
    out += [Kernel("_fused_rms_norm", "forward", 1, 8 * n, kind="rms_norm_fp32")]  # reads x fp32, writes y fp32
    out += [Kernel("copy_", "forward", 1, (4 + a) * n)] if cast else []  # .to(x.dtype)
    out += [Kernel("mul", "forward", 1, 2 * a * n, strided=True, kind="mul_norm_weight"),  # weight * y: reads y
            # backward of weight * y: grad · y for the weight (read two, write one), summed over the tokens into
            # [h] (reads one), and grad · weight for y (read one, write one)
            Kernel("mul", "backward", 1, 3 * a * n, kind="mul_contiguous"), Kernel("sum", "backward", 1, a * n),
            Kernel("mul", "backward", 1, 2 * a * n, strided=True, kind="mul_norm_weight")]
    out += [Kernel("copy_", "backward", 1, (a + 4) * n, kind=up)] if cast else []  # ToCopyBackward0 of .to(x.dtype)
    out += [Kernel("_fused_rms_norm_backward", "backward", 1, 12 * n)]  # reads grad, x; writes grad, fp32
    out += [Kernel("copy_", "backward", 1, (4 + a) * n)] if cast else []  # ToCopyBackward0 of x.float()
    return out


def rotate(n: float, a: int) -> list[Kernel]:
    """RoPE on one of q, k of ``n`` elements (plait/models/rotary.py ``rotate``: ``x * cos + x.roll(hd/2, -1) *
    sin``, x the [B, heads, S, hd] transpose of its projection's view, ``Attention.heads``) and its backward.
    torch's CUDA ``roll`` copies a non-contiguous input to a contiguous one first (aten/src/ATen/native/cuda/
    TensorTransformations.cu, ``roll_cuda``: ``self.contiguous()``): the forward's x is the transposed view;
    the backward's gradient keeps the [B, S, heads, hd] memory order of the query (element-wise outputs follow
    their first operand's, and cuDNN's attention gives dq in q's), so its roll copies too."""
    mul, copy, roll, add = "mul_rope_table", "copy_transpose", "roll", "add_mixed_layouts"
    return [Kernel("mul", "forward", 2, 2 * 2 * a * n, True, mul),  # x · cos, roll(x) · sin (tables broadcast)
            Kernel("copy_", "forward", 1, 2 * a * n, True, copy), Kernel("roll", "forward", 1, 2 * a * n, kind=roll),
            Kernel("add", "forward", 1, 3 * a * n, True, add),  # the two products' layouts differ
            # backward: grad · sin (to the roll), grad · cos (to x), the roll back with its copy, and the two
            # gradients of x summed (autograd's accumulation of a tensor used twice)
            Kernel("mul", "backward", 2, 2 * 2 * a * n, True, mul),
            Kernel("copy_", "backward", 1, 2 * a * n, True, copy),
            Kernel("roll", "backward", 1, 2 * a * n, kind=roll), Kernel("add", "backward", 1, 3 * a * n, True, add)]


def widths(model: Model, layout: Layout) -> tuple[float, float, float, float, float]:
    """(norm elements, query elements, key elements, MLP elements, routed tokens) of one layer's micro-batch."""
    t = layout.tp
    tokens = layout.microbatch_size * model.seq_len / layout.cp
    norm_tokens = tokens / t if layout.sequence_parallel else tokens
    q = model.n_heads / t * model.head_dim
    kv = max(model.kv_heads / t, 1.0) * model.head_dim
    routed = tokens * model.top_k * experts.received(model, layout) if model.is_moe else tokens
    return norm_tokens * model.hidden, tokens * q, tokens * kv, routed * model.ffn / t, routed


def layer_kernels(model: Model, layout: Layout, precision: str) -> list[Kernel]:
    """One decoder layer (plait/models/llama.py ``DecoderLayer.forward``: ``h = x + attn(norm(x))``, then ``h +
    mlp(norm(h))``) forward and backward, for one micro-batch on one GPU. The projections, the attention core
    (SDPA) and the weight gradients' accumulation are costed elsewhere (``plan.gemm``, ``plan.attention``,
    ``plan.accumulation``)."""
    a = dtype_bytes(precision)
    n, nq, nk, nf, _ = widths(model, layout)
    out = rms_norm(n, a) + rms_norm(n, a) + rotate(nq, a) + rotate(nk, a)
    out += [Kernel("add", "forward", 2, 2 * 3 * a * n, kind="add_contiguous")]  # the two residual adds [T, h]
    if model.glu:  # SwiGLU (``MLP.forward``: down(silu(gate(x)) * up(x))), [T, f]
        out += [Kernel("silu", "forward", 1, 2 * a * nf),
                Kernel("mul", "forward", 1, 3 * a * nf, kind="mul_contiguous"),
                Kernel("mul", "backward", 2, 2 * 3 * a * nf, kind="mul_contiguous"),  # grad · up, grad · silu(gate)
                Kernel("silu_backward", "backward", 1, 3 * a * nf)]  # reads grad and gate, writes [T, f]
    else:  # an activation alone (plait's runtime runs GLU models only)
        out += [Kernel("silu", "forward", 1, 2 * a * nf), Kernel("silu_backward", "backward", 1, 3 * a * nf)]
    # autograd sums the gradients of a tensor used more than once (read two, write one, [T, h]): x (its norm and the
    # residual), the first norm's output (q, k and v projections: two sums), h (its norm and the residual), the
    # second norm's output (gate and up: one sum; without a GLU none)
    sums = 5 if model.glu else 4
    out += [Kernel("add", "backward", sums, sums * 3 * a * n, kind="add_contiguous")]
    # q's two gradients (rotate's) are summed into the one autograd reaches first, the roll's: torch's roll writes a
    # contiguous [B, heads, S, hd] (roll_cuda's empty_like(..., LEGACY_CONTIGUOUS_MEMORY_FORMAT)), so the transpose
    # back to [B, S, heads, hd] is not contiguous and the backward of ``Attention.heads``' view (a reshape) copies
    # it; the same for k (v's gradient keeps v's layout: no copy)
    out += [Kernel("copy_", "backward", 2, 2 * a * (nq + nk), strided=True, kind="copy_transpose")]
    return out


def head_kernels(model: Model, layout: Layout, precision: str) -> list[Kernel]:
    """The final norm and the loss (plait/tensor_parallel/loss.py ``_VocabParallelCE``) over this rank's [T, V/t]
    logits, forward and backward. The loss works in float32: the logits cast up (``logits.float()``), their row
    maxima (reads them), ``z - z_max``, ``exp``, its row sums (reads it), the softmax by ``div_`` in place; the
    backward clones the saved softmax, subtracts one at each target (one element a row), scales it by the
    incoming gradient (``grad * scale``) and casts it back to the logits' dtype."""
    a = dtype_bytes(precision)
    n, *_ = widths(model, layout)
    tokens = layout.microbatch_size * model.seq_len / layout.cp
    v = tokens * model.vocab / layout.tp
    cast = a != 4
    out = rms_norm(n, a)
    out += [Kernel("copy_", "forward", 1, (a + 4) * v, kind="cast_to_fp32")] if cast else []
    out += [Kernel("max", "forward", 1, 4 * v), Kernel("sub", "forward", 1, 8 * v), Kernel("exp", "forward", 1, 8 * v),
            Kernel("sum", "forward", 1, 4 * v), Kernel("div_", "forward", 1, 8 * v),
            Kernel("copy_", "backward", 1, 8 * v), Kernel("mul", "backward", 1, 8 * v, strided=True)]  # scale [N, 1]
    out += [Kernel("copy_", "backward", 1, (4 + a) * v)] if cast else []
    return out


def step_kernels(params: float, tensors: int, precision: str, zero: int) -> list[Kernel]:
    """Once a step: under bf16 without ZeRO every float32 parameter is cast to a bf16 copy for the step
    (plait/optim/precision.py ``StepCast._copies``: ``p.to(bf16)``, one kernel per tensor, read 4 write 2). ZeRO-1/2
    keep the parameters in bf16 and ZeRO-3 gathers them in it (their copies: ``plan.step_end``)."""
    if precision != "bf16" or zero:
        return []
    return [Kernel("copy_", "forward", tensors, 6 * params)]


def seconds(kernels: list[Kernel], bandwidth: float, rates: KernelRates | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of ``kernels`` streaming their bytes at ``bandwidth`` (B/s), or, given the
    GPU's measured ``rates``, each at the rate of its kind (``KernelRates.rate``)."""
    out = {"forward": 0.0, "backward": 0.0}
    for k in kernels:
        out[k.phase] += k.nbytes / (bandwidth if rates is None else rates.rate(k.kind, k.strided, bandwidth))
    return out["forward"], out["backward"]


def by_op(kernels: list[Kernel]) -> dict[str, tuple[int, float]]:
    """Launches and bytes per operator over both passes."""
    out: dict[str, tuple[int, float]] = {}
    for k in kernels:
        calls, nbytes = out.get(k.op, (0, 0.0))
        out[k.op] = (calls + k.calls, nbytes + k.nbytes)
    return out
