"""Context-parallel attention, applied from outside the model to each attention module of its family adapter.

An attention module (plait.models.llama.Attention) computes q, k, v for its tokens, rotates them with
``rope(S, offset, dtype)`` and calls ``core(q, k, v, mask)``. Under context parallelism its tokens are the
CP rank's two chunks (plait.context_parallel.layout), so two of the module's methods are shadowed on the
instance (as plait.recompute shadows ``core``): ``rope`` gives the cos/sin of the tokens' *global*
positions, and ``core`` attends over the keys and values of the whole sequence, with the causal (and
sliding-window) mask built from global positions — the mask the module built from local positions is not
used. Two ways to see the other ranks' keys and values (``cp_comm``):

allgather  all-gather K and V over the CP group, then the module's own core (so selective recomputation,
           which wraps that core, still applies); the backward reduce-scatters their gradients. Memory: the
           whole sequence's K/V per layer, small with grouped-query attention.
ring       K/V blocks travel around the CP group point to point while each rank attends to the block it
           holds; partial results are merged by their log-sum-exp (Liu et al. 2023, "Ring Attention with
           Blockwise Transformers"; the merge of Milakov & Gimelshein 2018, "Online normalizer calculation
           for softmax"). The backward recomputes each block's probabilities from the saved log-sum-exp (as
           FlashAttention, Dao et al. 2022) and sends the blocks' K/V gradients around with them. Memory: one
           block of K/V at a time and no probabilities kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from plait.context_parallel.comms import Ring, gather_kv
from plait.context_parallel.layout import causal_mask, gathered_positions, local_positions
from plait.errors import ConfigError
from plait.parallel_config import CP_COMMS

TILE = 512  # query rows per score tile in the ring's block attention: [B, h, TILE, S/cp] floats at a time


class GlobalRope:
    """Shadows ``rope(seq_len, offset, dtype)``: cos, sin [1, 1, S/cp, hd] at this CP rank's global positions."""

    def __init__(self, rope_at: Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]],
                 cp: int, rank: int):
        self.rope_at, self.cp, self.rank = rope_at, cp, rank

    def __call__(self, seq_len: int, offset: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if offset:
            raise ConfigError("context parallelism runs training and evaluation over whole sequences, not decoding "
                              "with a KV cache; decode with a model loaded under cp=1")
        return self.rope_at(local_positions(seq_len, self.cp, self.rank)[None], dtype)


class GatheredCore:
    """Shadows ``core``: all-gather K/V over the CP group, then the module's own core with the global mask."""

    def __init__(self, core: Callable[..., torch.Tensor], group, cp: int, rank: int, window: int | None):
        self.core, self.group, self.cp, self.rank, self.window = core, group, cp, rank, window

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        s = q.shape[2]  # q [B, h, S/cp, hd], k, v [B, h_kv, S/cp, hd]
        q_pos = local_positions(s, self.cp, self.rank, q.device)
        k_pos = gathered_positions(s, self.cp, q.device)
        k, v = gather_kv(k, self.group), gather_kv(v, self.group)  # [B, h_kv, S, hd]
        return self.core(q, k, v, causal_mask(q_pos, k_pos, self.window))  # [B, h, S/cp, hd]


class RingCore:
    """Shadows ``core``: ring attention over the CP group (the module's own core is not called)."""

    def __init__(self, group, cp: int, rank: int, window: int | None):
        self.ring, self.cp, self.rank, self.window = Ring(group), cp, rank, window

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return _RingAttention.apply(q, k, v, self)


def _repeat(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)  # grouped-query: KV heads shared by groups


def _fold(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Sum the gradients of repeated KV heads: [B, h, S, hd] -> [B, h_kv, S, hd]."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // n_rep, n_rep, s, d).sum(2)


def _segments(pos: torch.Tensor) -> list[slice]:
    """The two contiguous chunks of a rank's positions (attended separately: one may be fully masked)."""
    half = pos.shape[0] // 2
    return [slice(0, half), slice(half, pos.shape[0])]


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B, h, Sq, hd] to one K/V block [B, h, Sk, hd] (float32) under ``mask`` [Sq, Sk]:
    (out [B, h, Sq, hd], lse [B, h, Sq, 1]); rows that see no key give out 0 and lse -inf."""
    out = q.new_zeros(q.shape)
    lse = q.new_full((*q.shape[:-1], 1), -math.inf)
    for a in range(0, q.shape[2], TILE):
        rows = slice(a, a + TILE)
        m_t = mask[rows]
        if not bool(m_t.any()):
            continue
        s = (q[:, :, rows] @ k.transpose(-1, -2)).mul_(scale).masked_fill_(~m_t, -math.inf)  # [B, h, T, Sk]
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        total = p.sum(-1, keepdim=True)
        out[:, :, rows] = (p @ v) / total.clamp_min(torch.finfo(total.dtype).tiny)
        lse[:, :, rows] = m + torch.log(total)
    return out, lse


def _merge(out: torch.Tensor | None, lse: torch.Tensor | None, o: torch.Tensor,
           o_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint keys by their log-sum-exps."""
    if out is None or lse is None:
        return o, o_lse
    new = torch.logaddexp(lse, o_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows that saw nothing yet stay 0
    return out * torch.exp(lse - safe) + o * torch.exp(o_lse - safe), new


def _block_backward(q, k, v, lse, dout, delta, mask, scale):
    """Gradients of one block's share: (dq [B, h, Sq, hd], dk, dv [B, h, Sk, hd]); probabilities recomputed
    from the final log-sum-exp ``lse`` (FlashAttention's backward, Dao et al. 2022, Alg. 4)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a in range(0, q.shape[2], TILE):
        rows = slice(a, a + TILE)
        m_t = mask[rows]
        if not bool(m_t.any()):
            continue
        s = (q[:, :, rows] @ k.transpose(-1, -2)).mul_(scale).masked_fill_(~m_t, -math.inf)
        p = torch.exp(s - lse[:, :, rows])  # [B, h, T, Sk]
        dv += p.transpose(-1, -2) @ dout[:, :, rows]
        ds = p * (dout[:, :, rows] @ v.transpose(-1, -2) - delta[:, :, rows])
        dq[:, :, rows] = (ds @ k) * scale
        dk += (ds.transpose(-1, -2) @ q[:, :, rows]) * scale
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    """softmax(q kᵀ/√hd + causal mask) v over the whole sequence's keys, K/V blocks passed around the ring."""

    @staticmethod
    def forward(ctx, q, k, v, core: RingCore):  # q [B, h, S/cp, hd], k, v [B, h_kv, S/cp, hd]
        ring, cp, n_rep = core.ring, core.cp, q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        s = q.shape[2]
        q_pos = local_positions(s, cp, core.rank, q.device)
        qf = q.float()
        out = lse = None
        kb, vb = k, v
        for step in range(cp):
            source = (core.rank - step) % cp  # whose block this rank holds now
            transfer = ring.start([kb, vb], tag=1) if step < cp - 1 else None
            k_pos = local_positions(s, cp, source, q.device)
            kf, vf = _repeat(kb.float(), n_rep), _repeat(vb.float(), n_rep)
            for seg in _segments(k_pos):
                o, o_lse = _block_forward(qf, kf[:, :, seg], vf[:, :, seg],
                                          causal_mask(q_pos, k_pos[seg], core.window), scale)
                out, lse = _merge(out, lse, o, o_lse)
            if transfer is not None:
                kb, vb = transfer.wait()
        assert out is not None and lse is not None
        ctx.core, ctx.scale = core, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        core, scale = ctx.core, ctx.scale
        ring, cp, n_rep = core.ring, core.cp, q.shape[1] // k.shape[1]
        s = q.shape[2]
        q_pos = local_positions(s, cp, core.rank, q.device)
        qf, do = q.float(), dout.float()
        delta = (do * out).sum(-1, keepdim=True)  # [B, h, S/cp, 1]
        dq = torch.zeros_like(qf)
        kb, vb = k, v
        dkb, dvb = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for step in range(cp):
            source = (core.rank - step) % cp
            transfer = ring.start([kb, vb], tag=1) if step < cp - 1 else None
            k_pos = local_positions(s, cp, source, q.device)
            kf, vf = _repeat(kb.float(), n_rep), _repeat(vb.float(), n_rep)
            dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
            for seg in _segments(k_pos):
                g_q, g_k, g_v = _block_backward(qf, kf[:, :, seg], vf[:, :, seg], lse, do, delta,
                                                causal_mask(q_pos, k_pos[seg], core.window), scale)
                dq += g_q
                dk[:, :, seg] += g_k
                dv[:, :, seg] += g_v
            # this block's gradient so far travels on with it; after cp hops it is back with its owner
            dkb, dvb = ring.start([dkb + _fold(dk, n_rep), dvb + _fold(dv, n_rep)], tag=2).wait()
            if transfer is not None:
                kb, vb = transfer.wait()
        return dq.to(q.dtype), dkb.to(k.dtype), dvb.to(v.dtype), None


def apply_context_parallel(modules: dict[str, nn.Module], ctx, comm: str, window: int | None,
                           model_name: str = "model") -> int:
    """Make every attention module in ``modules`` (name -> module) attend across ``ctx``'s CP group; returns how
    many. Apply after selective recomputation (plait.recompute), whose wrapped core the all-gather mode calls."""
    if comm not in CP_COMMS:
        raise ConfigError(f"cp_comm={comm!r}: choose one of {', '.join(CP_COMMS)}")
    if not modules:
        raise ConfigError(f"cp={ctx.cp_size}: {model_name}'s family adapter names no attention modules, so its "
                          "sequences cannot be split; use cp=1")
    for name, module in modules.items():
        methods: dict[str, Callable] = {}
        for method in ("core", "rope", "rope_at"):
            fn = getattr(module, method, None)
            if not callable(fn):
                raise ConfigError(f"cp={ctx.cp_size}: attention module {name} has no {method}() to run under "
                                  "context parallelism; use cp=1")
            methods[method] = fn
        setattr(module, "rope", GlobalRope(methods["rope_at"], ctx.cp_size, ctx.cp_rank))  # noqa: B010
        core = (RingCore(ctx.cp_group, ctx.cp_size, ctx.cp_rank, window) if comm == "ring"
                else GatheredCore(methods["core"], ctx.cp_group, ctx.cp_size, ctx.cp_rank, window))
        setattr(module, "core", core)  # noqa: B010  (nn.Module.__setattr__ is typed for tensors and modules)
    return len(modules)


def check_context_parallel(model: nn.Module, cp: int, loss_fn) -> None:
    """ConfigError (no collective) for what cannot run with its sequences split over ``cp`` ranks."""
    from plait.models.moe import MoE

    if loss_fn is not None:
        raise ConfigError(f"cp={cp} with loss_fn: a custom loss sees one micro-batch's rows, but context "
                          "parallelism hands each rank a part of every row; use the family's next-token loss "
                          "(loss_fn=None) or cp=1")
    capped = [m for m in model.modules() if isinstance(m, MoE) and m.capacity_factor is not None]
    if capped:
        raise ConfigError(f"cp={cp} with capacity_factor={capped[0].capacity_factor}: expert capacity ranks a whole "
                          "sequence's tokens in position order, which context parallelism splits over ranks; use "
                          "capacity_factor=None (dropless) or cp=1")
