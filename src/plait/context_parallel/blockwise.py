"""Exact attention of a rank's queries to keys at arbitrary global positions, block by block (no score kept).

Keys come in segments (runs of consecutive positions: the chunks of plait.context_parallel.layout); each
segment's scores are computed TILE query rows at a time under the causal (and sliding-window) mask of the
global positions, ANDed with the document mask of packed samples (plait.documents) when given, and the
partial results are merged by their log-sum-exp (Milakov & Gimelshein 2018, "Online normalizer calculation
for softmax"). The backward recomputes each tile's probabilities from the final log-sum-exp (FlashAttention's
backward, Dao et al. 2022, Alg. 4). A tile that sees no key is skipped, so a chunk wholly in the future of the
queries (or wholly in other documents) costs nothing. Shapes: q [B, h, Sq, hd], k and v [B, h_kv, Sk, hd]
(grouped-query: h_kv divides h), float32.
"""

from __future__ import annotations

import math

import torch

from plait.context_parallel.layout import causal_mask
from plait.parallel_config import CP_TILE as TILE  # query rows per score tile: [B, h, TILE, segment] floats at a time


def _repeat(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)  # KV heads shared by groups of query heads


def _fold(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Sum the gradients of repeated KV heads: [B, h, S, hd] -> [B, h_kv, S, hd]."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // n_rep, n_rep, s, d).sum(2)


def _segments(length: int, chunk: int) -> list[slice]:
    return [slice(a, min(a + chunk, length)) for a in range(0, length, chunk)]


Docs = tuple[torch.Tensor, torch.Tensor] | None  # document ids of the queries [B, Sq] and keys [B, Sk]


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, docs: Docs, seg: slice) -> torch.Tensor:
    """Which keys of segment ``seg`` each query sees: [Sq, Sk] (causal and window), [B, 1, Sq, Sk] with ``docs``
    (and in the same document)."""
    mask = causal_mask(q_pos, k_pos[seg], window)
    if docs is None:
        return mask
    q_doc, k_doc = docs
    return (mask & (q_doc[:, :, None] == k_doc[:, None, seg]))[:, None]


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q kᵀ·scale [B, h, T, Sk] with the keys a query does not see at -inf (no masking pass when it sees all)."""
    s = (q @ k.transpose(-1, -2)).mul_(scale)
    return s if bool(mask.all()) else s.masked_fill_(~mask, -math.inf)


def merge(out: torch.Tensor | None, lse: torch.Tensor | None, o: torch.Tensor,
          o_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint keys by their log-sum-exps ([B, h, Sq, 1])."""
    if out is None or lse is None:
        return o, o_lse
    new = torch.logaddexp(lse, o_lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows that saw nothing yet stay 0
    return out * torch.exp(lse - safe) + o * torch.exp(o_lse - safe), new


def _forward_block(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q against one segment; rows that see no key give out 0 and lse -inf."""
    out = q.new_zeros(q.shape)
    lse = q.new_full((*q.shape[:-1], 1), -math.inf)
    for a in range(0, q.shape[2], TILE):
        rows = slice(a, a + TILE)
        if not bool(mask[..., rows, :].any()):
            continue
        s = _scores(q[:, :, rows], k, mask[..., rows, :], scale)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = s.sub_(m).exp_()  # in place: one [B, h, T, Sk] buffer per tile
        total = p.sum(-1, keepdim=True)
        out[:, :, rows] = (p @ v) / total.clamp_min(torch.finfo(total.dtype).tiny)
        lse[:, :, rows] = m + torch.log(total)
    return out, lse


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
           window: int | None, chunk: int, out: torch.Tensor | None = None,
           lse: torch.Tensor | None = None, docs: Docs = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` merged with the attention of q (float32) to k, v at ``k_pos``, ``chunk`` keys at a time;
    ``docs``: the document ids of the queries and keys (packed samples), else one document per row."""
    n_rep, scale = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
    kf, vf = _repeat(k.float(), n_rep), _repeat(v.float(), n_rep)
    for seg in _segments(k.shape[2], chunk):
        o, o_lse = _forward_block(q, kf[:, :, seg], vf[:, :, seg], _mask(q_pos, k_pos, window, docs, seg), scale)
        out, lse = merge(out, lse, o, o_lse)
    assert out is not None and lse is not None
    return out, lse


def attend_backward(q, k, v, q_pos, k_pos, window, chunk, lse, dout, delta, docs: Docs = None):
    """Gradients of the keys' share of the attention: (dq [B, h, Sq, hd], dk, dv [B, h_kv, Sk, hd]), float32;
    ``lse`` the final log-sum-exp over every key, ``delta`` = rowsum(dout · out)."""
    n_rep, scale = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
    kf, vf = _repeat(k.float(), n_rep), _repeat(v.float(), n_rep)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kf), torch.zeros_like(vf)
    for seg in _segments(k.shape[2], chunk):
        mask = _mask(q_pos, k_pos, window, docs, seg)
        for a in range(0, q.shape[2], TILE):
            rows = slice(a, a + TILE)
            if not bool(mask[..., rows, :].any()):
                continue
            p = _scores(q[:, :, rows], kf[:, :, seg], mask[..., rows, :], scale).sub_(lse[:, :, rows]).exp_()
            dv[:, :, seg] += p.transpose(-1, -2) @ dout[:, :, rows]
            ds = (dout[:, :, rows] @ vf[:, :, seg].transpose(-1, -2)).sub_(delta[:, :, rows]).mul_(p)
            dq[:, :, rows] += (ds @ kf[:, :, seg]) * scale
            dk[:, :, seg] += (ds.transpose(-1, -2) @ q[:, :, rows]) * scale
    return dq, _fold(dk, n_rep), _fold(dv, n_rep)
