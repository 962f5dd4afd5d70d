"""plait's own eager runtime, tensor by tensor: what autograd saves and which kernels a Llama block runs.

The planner's model of ``plait train`` on a calibrated host (``Cluster.from_profile``), counted from
``plait.models.Llama`` under plait's TP plan, per rank and per micro-batch of ``T`` tokens. Sizes in
elements: ``N = T·h`` (hidden state; ``N/t`` where sequence parallelism shards it), ``Q = T·q`` (this
rank's query heads × head size), ``K = T·kv`` (its KV heads; replicated when tp > n_kv_heads), ``F = T·f/t``
(MLP width).

Saved for backward (what ``torch.autograd.graph.saved_tensors_hooks`` sees, each storage once):
* RMSNorm: its input, x·rsqrt(mean x²) and the scaled output the next linear keeps (3 N; under SP 3 N/t: the
  projections of the region keep the output's sequence shard and all-gather it again in the backward,
  plait.tensor_parallel.regather; with full recomputation they keep the gathered N, 2 N/t + N, as an MoE
  layer's router and experts do)
  plus the ``T`` rsqrt values; twice per layer (the second input is the attention residual); it computes in
  float32, so in bf16 the input's copy and the rsqrt values are float32;
* per-head norms (``Model.head_norms``, Qwen3's on q and k): each RMSNorm's input (``Q`` or ``K``, float32), its
  normalised output (what its weight's product keeps) and one float32 rsqrt per head and token;
* attention: Q after RoPE, K and V as SDPA receives them (``K`` each: grouped-query attention shares them
  inside SDPA, never repeated), its output ``Q`` (which is also
  the output projection's input), its log-sum-exp ``T·heads`` (float32);
* a sliding window (``Model.sliding_window``): its ``s·s`` mask, which SDPA keeps as an additive mask in the
  compute dtype (under selective recomputation the core's checkpoint keeps the boolean one), on the layers whose
  window hides keys (``Model.window_layer_share``: a layer's figure is the layers' mean);
* RoPE's cos and sin tables ``2·s·d``, once per rank: the model's layers share them (plait.models.rotary),
  so every layer and micro-batch of a step saves the same two tensors;
* SwiGLU: gate and up outputs, silu(gate) and the product ``4 F``;
* a mixture-of-experts layer: its experts as SwiGLU at ``F = T·top_k·f/t``, and its router, token dispatch and
  combine (``plan.host.experts``), the experts' rows, their GEMMs and SwiGLU kernels at ``Local.received`` times
  balanced routing's (the busiest rank of an EP group, which the others wait for);
* head: the final norm's three tensors, the softmax of the vocabulary-parallel loss ``T·V/t`` (float32);
* selective recomputation (the attention core under a checkpoint) drops the log-sum-exp;
* context parallelism (plait.context_parallel, over ``cp`` ranks; ``T`` a rank's S/cp tokens): its core
  replaces SDPA (and selective recomputation's core) and saves q, the K and V it attends with
  (the whole sequence's, ``cp·K`` each, when they are all-gathered; the ring's travelling blocks are freed
  as it goes, so its own ``K``), its output and log-sum-exp in float32 whatever the precision, and the
  output projection keeps its own contiguous copy of the output (``Q``);
* full recomputation (a checkpoint per block) keeps each block's input instead.

Kernels: the seven GEMMs of a layer and the head's, SDPA, and the element-wise kernels with the bytes
they move (a norm reads and writes its ``N`` elements about 7 times, RoPE 9 per rotated element, SwiGLU
5 per ``F``, a residual add 3); ``plait calibrate`` times the same mix, so its bytes/s apply here.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan import experts as plan_experts
from plait.plan.config import Layout
from plait.plan.host.experts import moe_saved
from plait.plan.model import Model

# Element traffic (reads + writes, in elements) and kernels of the forward of each element-wise group;
# plait.calibrate times exactly these groups, so its bytes/s are measured per byte counted here.
NORM_TRAFFIC, NORM_OPS = 7, 6  # pow, mean, +eps, rsqrt, ·rsqrt, ·weight
ROPE_TRAFFIC, ROPE_OPS = 9, 4  # ·cos, roll, ·sin (its first half negated), + (plait.models.rotary.rotate)
GLU_TRAFFIC, GLU_OPS = 5, 2  # silu, ·up
RESIDUAL_TRAFFIC, RESIDUAL_OPS = 3, 1
LINEAR_OPS = 2  # the matmul and its reshapes
VIEW_OPS = 0.5  # a view or transpose costs about half a kernel's dispatch


@dataclass(frozen=True)
class Local:
    """Sizes on one rank for one micro-batch (elements; see the module docstring)."""

    tokens: float  # T
    seq: float  # s (local: /cp)
    hidden: int
    head_dim: int
    heads: float  # query heads on this rank
    kv_heads: float  # KV heads on this rank (replicated when tp > n_kv_heads)
    ffn: float  # f/t
    vocab: float  # padded vocabulary / t
    tp: int
    sp: bool
    cp: int = 1
    cp_gather: bool = False  # context parallelism all-gathers K and V (else the ring passes them around)
    regather: bool = True  # under SP the regions' projections keep their input's shard (not with full recomputation)
    experts: int = 1  # E of a mixture-of-experts layer (1: dense); its top-k, EP size and placement
    top_k: int = 1
    ep: int = 1
    expert_split: bool = False  # each expert split over TP (plan.experts.split), else whole experts
    received: float = 1.0  # the rows its experts receive, times balanced routing's (plan.experts.received)
    head_norms: tuple[str, ...] = ()  # the projections ("q", "k") whose heads an RMSNorm normalises
    window: float = 0.0  # the share of layers whose attention takes a sliding window's mask

    @property
    def n(self) -> float:
        return self.tokens * self.hidden

    @property
    def n_local(self) -> float:  # the hidden state where SP shards it
        return self.n / self.tp if self.sp else self.n

    @property
    def moe(self) -> bool:  # the MLP is a mixture of experts, which gathers its input itself and keeps it whole
        return self.experts > 1

    @property
    def regathers(self) -> int:  # regions whose input the backward gathers again (the MoE gathers its own)
        return (1 if self.moe else 2) if self.sp and self.regather else 0

    @property
    def region_kept(self) -> float:  # what a region's projections keep of its input for the backward
        return self.n_local if self.sp and self.regather else self.n

    @property
    def q(self) -> float:
        return self.tokens * self.heads * self.head_dim

    @property
    def k(self) -> float:
        return self.tokens * self.kv_heads * self.head_dim

    @property
    def f(self) -> float:
        return self.tokens * self.ffn


def local(model: Model, layout: Layout) -> Local:
    t = layout.tp
    tokens = layout.microbatch_size * model.seq_len / layout.cp
    vocab = -(-model.vocab // t) * t / t  # padded to a multiple of tp
    # an MoE layer's experts count as one MLP of width top_k·f/t: whole experts on a TP rank's 1/t of the routed
    # rows or split ones on all of them hold the same elements (plan.experts); the router and the dispatch are
    # counted apart (plan.host.experts)
    return Local(tokens, model.seq_len / layout.cp, model.hidden, model.head_dim, model.n_heads / t,
                 max(model.kv_heads / t, 1.0), model.ffn * (model.top_k if model.is_moe else 1) / t, vocab, t,
                 layout.sequence_parallel and t > 1, layout.cp, layout.cp > 1 and layout.cp_comm == "allgather",
                 layout.recompute != "full", model.n_experts, model.top_k, layout.ep, plan_experts.split(layout),
                 plan_experts.received(model, layout), model.head_norms, model.window_layer_share)


# ------------------------------------------------------------------------------------------ memory
# Under SP each TP region all-gathers its input along the sequence into one contiguous buffer (a copy out
# of the gather's rank-major layout) that its column-parallel projections share, two per layer; they keep the
# input's shard for the backward and all-gather it again there into the same kind of buffer, once per region
# (``Local.regather``; with full recomputation they keep the gathered buffer instead, and gather nothing again).
SP_GATHER_COPIES = 2


def _norm_saved(sh: Local, dtype_bytes: int, kept: float) -> float:
    """RMSNorm computes in float32: its input's float32 copy and the rsqrt values are float32 whatever the
    precision; the normalized values cast back and what the next linear keeps of the scaled output (``kept``
    elements) are not."""
    fp32 = 4 / dtype_bytes
    return sh.n_local * fp32 + sh.n_local + kept + sh.tokens / (sh.tp if sh.sp else 1) * fp32


def layer_saved(sh: Local, selective: bool = False, dtype_bytes: int = 4) -> float:
    """Elements (of ``dtype_bytes`` each) one decoder layer saves for backward per micro-batch (no
    recomputation, or ``selective``: the attention core under a checkpoint keeps its inputs q, k, v, not the
    log-sum-exp)."""
    if sh.cp > 1:
        attention = _cp_attention_saved(sh, dtype_bytes)
    else:
        lse = 0.0 if selective else sh.tokens * sh.heads * 4 / dtype_bytes  # float32
        attention = sh.q + 2 * sh.k + sh.q + lse + sh.window * _window_mask_saved(sh, dtype_bytes, selective)
    norms = _norm_saved(sh, dtype_bytes, sh.region_kept)  # the attention's input
    norms += _norm_saved(sh, dtype_bytes, sh.n if sh.moe else sh.region_kept)  # the MLP's
    # the MLP's 4 F (an MoE layer's experts on the rows they receive), an MoE layer's router and dispatch
    norms += sum(_head_norm_saved(sh, dtype_bytes, name) for name in sh.head_norms)
    return norms + attention + 4 * sh.f * sh.received + moe_saved(sh, dtype_bytes)


def _head_norm_saved(sh: Local, dtype_bytes: int, name: str) -> float:
    """An RMSNorm over each head of the rank's queries ("q") or keys ("k") (plait.models.llama
    ``Attention.heads``): its input's float32 copy (the projection's output itself in float32), the normalised
    values cast back, which its weight's product keeps, and one float32 rsqrt per head and token. RoPE, next,
    keeps only its tables."""
    fp32 = 4 / dtype_bytes
    n, heads = (sh.q, sh.heads) if name == "q" else (sh.k, sh.kv_heads)
    return n * fp32 + n + sh.tokens * heads * fp32


def _window_mask_saved(sh: Local, dtype_bytes: int, selective: bool) -> float:
    """A sliding window's mask (plait.models.llama ``window_mask``: one boolean per query and key, [s, s], made
    per layer and micro-batch): SDPA turns it into an additive mask in the compute dtype and keeps that; under
    selective recomputation the checkpointed core keeps the boolean mask it was given (1 B each) instead."""
    return sh.seq * sh.seq / (dtype_bytes if selective else 1)


def _cp_attention_saved(sh: Local, dtype_bytes: int) -> float:
    """Context parallelism's attention (``plait.context_parallel.attention``): q, K and V as its core keeps
    them (all-gathered: the whole sequence's), its float32 output and log-sum-exp, the output projection's
    copy of the output."""
    fp32 = 4 / dtype_bytes
    kv = sh.k * (sh.cp if sh.cp_gather else 1)
    return sh.q + 2 * kv + (sh.q + sh.tokens * sh.heads) * fp32 + sh.q


def rope_tables_saved(sh: Local) -> float:
    """RoPE's cos and sin at the rank's ``s`` positions: one pair for all layers and micro-batches."""
    return 2 * sh.seq * sh.head_dim


def head_saved(sh: Local, dtype_bytes: int = 4) -> float:
    """Final norm and the loss's float32 softmax, int64 targets and two masks (10 bytes a token), in elements of
    ``dtype_bytes``."""
    # the head gathers its input itself (under SP) and keeps it whole
    return _norm_saved(sh, dtype_bytes, sh.n) + (sh.tokens * sh.vocab + 2.5 * sh.tokens) * 4 / dtype_bytes


def embedding_saved(sh: Local) -> float:
    """The int64 ids (2 elements' worth each), and the out-of-shard mask with TP."""
    return sh.tokens * (2.0 + (0.25 if sh.tp > 1 else 0.0))


def checkpoint_saved(sh: Local) -> float:
    """Full recomputation: a checkpointed block keeps only its input."""
    return sh.n_local


# -------------------------------------------------------------------------------------------- time
@dataclass(frozen=True)
class Work:
    """Forward work of one block for one micro-batch: GEMMs as (FLOPs, size the rate is keyed by: FLOPs), attention
    FLOPs (4·s²·d per head, non-causal count) at size s·d, element-wise bytes and kernels (with backward)
    and forward-only kernels."""

    gemms: tuple[tuple[float, float], ...] = ()
    attention: float = 0.0
    attention_size: float = 1.0
    elem_bytes: float = 0.0
    ops: float = 0.0
    nograd_ops: float = 0.0


def _gemm(m: float, n: float, k: float) -> tuple[float, float]:
    flops = 2 * m * n * k
    return flops, flops


def layer_work(sh: Local, dtype_bytes: int) -> Work:
    t, h = sh.tokens, sh.hidden
    q, kv = sh.heads * sh.head_dim, sh.kv_heads * sh.head_dim
    f = sh.ffn * sh.received  # an MoE layer's experts on the rows its busiest rank receives
    gemms = (_gemm(t, q, h), _gemm(t, kv, h), _gemm(t, kv, h), _gemm(t, h, q), _gemm(t, f, h), _gemm(t, f, h),
             _gemm(t, h, f))
    traffic = 2 * NORM_TRAFFIC * sh.n_local + 2 * RESIDUAL_TRAFFIC * sh.n_local + ROPE_TRAFFIC * (sh.q + sh.k)
    traffic += GLU_TRAFFIC * sh.f * sh.received
    ops: float = 2 * NORM_OPS + 2 * RESIDUAL_OPS + 2 * ROPE_OPS + GLU_OPS + 7 * LINEAR_OPS + 1  # + SDPA
    ops += 12 * VIEW_OPS  # q/k/v view + transpose, rotate_half's chunks, output transpose + reshape
    if sh.tp > 1:  # the all-reduce's copy (or SP's gather / reduce-scatter buffers), in and out of 2 regions
        traffic += 4 * sh.n_local if sh.sp else 4 * sh.n
        ops += 4
    if sh.sp:  # each region's contiguous copy of the gathered input (read + write), again in the backward where
        # its projections kept the shard
        copies = SP_GATHER_COPIES + sh.regathers
        traffic += 2 * copies * sh.n
        ops += copies
    # each of the rank's queries against the row's keys, cp·s of them (without causal savings, as at cp = 1 and as
    # the calibration counts SDPA's FLOPs): under context parallelism the causal load balance gives a rank 1/cp
    # of the row's causal pairs, not (1/cp)² as its own s keys alone would
    attention = 4 * t * sh.seq * sh.cp * q
    return Work(gemms, attention, sh.seq * sh.head_dim, traffic * dtype_bytes, ops)


def head_work(sh: Local, dtype_bytes: int) -> Work:
    """Final norm, the vocabulary-sharded head and the loss (max, shift, exp, sums, log, gather: ~8
    passes over the local logits, in fp32)."""
    gemm = _gemm(sh.tokens, sh.vocab, sh.hidden)
    traffic = NORM_TRAFFIC * sh.n_local * dtype_bytes + 8 * sh.tokens * sh.vocab * 4
    return Work((gemm,), elem_bytes=traffic, ops=NORM_OPS + LINEAR_OPS + 12, nograd_ops=2)


def final_norm_work(sh: Local, dtype_bytes: int) -> Work:
    """The final norm of ``head_work`` alone (a block of its own in plait's runtime)."""
    return Work(elem_bytes=NORM_TRAFFIC * sh.n_local * dtype_bytes, ops=NORM_OPS)


def embedding_work(sh: Local, dtype_bytes: int) -> Work:
    """The lookup (and with TP the shard mask and the all-reduce's copy)."""
    extra = 3 if sh.tp > 1 else 0
    return Work(elem_bytes=(2 + extra) * sh.n * dtype_bytes, ops=2 + extra)
