"""Context-parallel attention, applied from outside the model to each attention module of its family adapter.

An attention module (plait.models.llama.Attention) computes q, k, v for its tokens, rotates them with
``rope(S, offset, dtype)`` and calls ``core(q, k, v, mask, causal)``. Under context parallelism its tokens are the
CP rank's two chunks (plait.context_parallel.layout), so two of the module's methods are shadowed on the
instance (as plait.recompute shadows ``core``): ``rope`` gives the cos/sin of the tokens' *global*
positions, and ``core`` attends over the keys and values of the whole sequence, with the causal (and
sliding-window) mask built from global positions — the mask the module built from local positions is not
used. Two ways to see the other ranks' keys and values (``cp_comm``):

allgather  all-gather K and V over the CP group; the backward reduce-scatters their gradients. Memory: the
           whole sequence's K/V per layer (h_kv heads: small with grouped-query attention).
ring       K/V blocks travel around the CP group point to point while each rank attends to the block it
           holds (Liu et al. 2023, "Ring Attention with Blockwise Transformers"); the backward sends the
           blocks' K/V gradients around with them. Memory: one block of K/V at a time. With a sliding window
           a rank computes nothing for a block none of its queries sees (``layout.sees``: with a window
           shorter than a chunk, every block but its neighbours'); the block still passes through it, the
           ring relaying it to the ranks after.
Both attend with plait.context_parallel.blockwise: exact attention merged by log-sum-exp, no probabilities
kept, so selective recomputation (which would recompute the module's core) has nothing left to save; a mask
of the whole sequence (S/cp × S) is never built. With document masking (plait.documents) the cores also keep
each query to the keys of its own document: the document ids of any block of keys come from the full rows every
CP rank holds (``Documents.pair``), so no id travels with a block, and tiles no query sees are not computed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from plait.context_parallel.blockwise import attend, attend_backward
from plait.context_parallel.comms import Ring, gather_kv
from plait.context_parallel.layout import gathered_positions, local_positions, sees
from plait.errors import ConfigError
from plait.models.family import attention_methods
from plait.parallel_config import CP_COMMS

if TYPE_CHECKING:
    from plait.distributed.context import ParallelContext
    from plait.documents import Documents
    from plait.parallel_model import LossFn


class LocalPositions:
    """This CP rank's global positions [1, S/cp] for a local length, one tensor kept per length: every layer is
    handed the same tensor, so the attention modules' shared rotary tables (``rope_at``) are built once."""

    def __init__(self, cp: int, rank: int):
        self.cp, self.rank = cp, rank
        self.kept: dict[int, torch.Tensor] = {}

    def __call__(self, seq_len: int) -> torch.Tensor:
        if seq_len not in self.kept:
            self.kept = {seq_len: local_positions(seq_len, self.cp, self.rank)[None]}  # the last length only
        return self.kept[seq_len]


KV = "keys and values"  # what the ring passes forward, each block with its gradients backward
NO_DECODING = ("context parallelism runs training and evaluation over whole sequences, not decoding with a KV "
               "cache; decode with a model loaded under cp=1")


def whole_sequences(causal: bool) -> None:
    """The CP cores attend causally over whole sequences split across the group; a non-causal call (one token
    decoded after cached ones) cannot reach them (``GlobalRope`` refuses the cache first), and is refused here too."""
    if not causal:
        raise ConfigError(NO_DECODING)


class GlobalRope:
    """Shadows ``rope(seq_len, offset, dtype)``: cos, sin [1, 1, S/cp, hd] at this CP rank's global positions."""

    def __init__(self, rope_at: Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]],
                 positions: LocalPositions):
        self.rope_at, self.positions = rope_at, positions

    def __call__(self, seq_len: int, offset: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if offset:
            raise ConfigError(NO_DECODING)
        return self.rope_at(self.positions(seq_len), dtype)


class CPCore:
    """What both CP cores hold: the group's size and this rank's index in it, the sliding window, and the
    documents of the micro-batch being run (None: no document masking)."""

    def __init__(self, cp: int, rank: int, window: int | None, documents: Documents | None):
        self.cp, self.rank, self.window, self.documents = cp, rank, window, documents

    def docs(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Document ids of the queries and keys at these global positions (None: one document per row)."""
        return None if self.documents is None else self.documents.pair(q_pos, k_pos)


class GatheredCore(CPCore):
    """Shadows ``core``: all-gather K/V over the CP group, then exact blockwise attention with the global mask."""

    def __init__(self, group, cp: int, rank: int, window: int | None, documents: Documents | None = None):
        super().__init__(cp, rank, window, documents)
        self.group = group

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 causal: bool = True) -> torch.Tensor:
        whole_sequences(causal)
        k, v = gather_kv(k, self.group, "keys"), gather_kv(v, self.group, "values")  # [B, h_kv, S, hd]
        return _GatheredAttention.apply(q, k, v, self)  # [B, h, S/cp, hd]


class RingCore(CPCore):
    """Shadows ``core``: ring attention over the CP group."""

    def __init__(self, group, cp: int, rank: int, window: int | None, documents: Documents | None,
                 timeout_s: float):
        super().__init__(cp, rank, window, documents)
        self.ring = Ring(group, timeout_s)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 causal: bool = True) -> torch.Tensor:
        whole_sequences(causal)
        return _RingAttention.apply(q, k, v, self)


class _GatheredAttention(torch.autograd.Function):
    """The local queries against the gathered keys (their gradients flow back through gather_kv's
    reduce-scatter); saves q, the gathered K/V, the output and its log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, core: GatheredCore):  # q [B, h, S/cp, hd], k, v [B, h_kv, S, hd]
        s = q.shape[2]
        q_pos, k_pos = local_positions(s, core.cp, core.rank, q.device), gathered_positions(s, core.cp, q.device)
        ctx.docs = core.docs(q_pos, k_pos)  # [b, S/cp], [b, S] (None: one document per row)
        out, lse = attend(q.float(), k, v, q_pos, k_pos, core.window, s // 2, docs=ctx.docs)
        ctx.core = core
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        core, s = ctx.core, q.shape[2]
        q_pos, k_pos = local_positions(s, core.cp, core.rank, q.device), gathered_positions(s, core.cp, q.device)
        do = dout.float()
        delta = (do * out).sum(-1, keepdim=True)  # [B, h, S/cp, 1]
        dq, dk, dv = attend_backward(q.float(), k, v, q_pos, k_pos, core.window, s // 2, lse, do, delta, ctx.docs)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class _RingAttention(torch.autograd.Function):
    """softmax(q kᵀ/√hd + causal mask) v over the whole sequence's keys, K/V blocks passed around the ring."""

    @staticmethod
    def forward(ctx, q, k, v, core: RingCore):  # q [B, h, S/cp, hd], k, v [B, h_kv, S/cp, hd]
        ring, cp, s = core.ring, core.cp, q.shape[2]
        q_pos, qf = local_positions(s, cp, core.rank, q.device), q.float()
        out = lse = None
        kb, vb = k, v
        for step in range(cp):
            source = (core.rank - step) % cp  # whose block this rank holds now
            transfer = ring.start([kb, vb], 1, KV) if step < cp - 1 else None
            if sees(core.rank, source, s, cp, core.window):  # its own block always: the diagonal
                k_pos = local_positions(s, cp, source, q.device)
                out, lse = attend(qf, kb, vb, q_pos, k_pos, core.window, s // 2, out, lse, core.docs(q_pos, k_pos))
            if transfer is not None:
                kb, vb = transfer.wait()
        ctx.core, ctx.docs = core, None if core.documents is None else core.documents.ids  # as they were
        ctx.save_for_backward(q, k, v, out, lse)
        assert out is not None
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        core = ctx.core
        ring, cp, s = core.ring, core.cp, q.shape[2]
        q_pos, qf, do = local_positions(s, cp, core.rank, q.device), q.float(), dout.float()
        delta = (do * out).sum(-1, keepdim=True)  # [B, h, S/cp, 1]
        dq = torch.zeros_like(qf)
        kb, vb = k, v
        dkb, dvb = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for step in range(cp):
            source = (core.rank - step) % cp
            transfer = ring.start([kb, vb], 1, KV) if step < cp - 1 else None
            if sees(core.rank, source, s, cp, core.window):
                k_pos = local_positions(s, cp, source, q.device)
                docs = None if ctx.docs is None else (ctx.docs[:, q_pos], ctx.docs[:, k_pos])
                g_q, g_k, g_v = attend_backward(qf, kb, vb, q_pos, k_pos, core.window, s // 2, lse, do, delta, docs)
                dq += g_q
                dkb, dvb = dkb + g_k, dvb + g_v
            # this block's gradient so far travels on with it; after cp hops it is back with its owner
            dkb, dvb = ring.start([dkb, dvb], 2, "keys' and values' gradients").wait()
            if transfer is not None:
                kb, vb = transfer.wait()
        return dq.to(q.dtype), dkb.to(k.dtype), dvb.to(v.dtype), None


def apply_context_parallel(modules: dict[str, nn.Module], ctx: ParallelContext, comm: str,
                           windows: dict[str, int | None], model_name: str = "model",
                           documents: Documents | None = None) -> int:
    """Make every attention module in ``modules`` (name -> module) attend across ``ctx``'s CP group, each with its
    sliding window of ``windows`` (name -> keys a query sees at most; None or absent: every earlier key), within
    the documents of ``documents`` if given; returns how many. The shadowed core replaces any earlier one
    (selective recomputation's: its attention keeps no probabilities to recompute)."""
    if comm not in CP_COMMS:
        raise ConfigError(f"cp_comm={comm!r}: choose one of {', '.join(CP_COMMS)}")
    if not modules:
        raise ConfigError(f"cp={ctx.cp_size}: {model_name}'s family adapter names no attention modules, so its "
                          "sequences cannot be split; use cp=1")
    positions = LocalPositions(ctx.cp_size, ctx.cp_rank)  # shared by the modules' GlobalRope
    for name, module in modules.items():
        methods = attention_methods(name, module, f"cp={ctx.cp_size}: attention module {{name}} has no {{method}}() "
                                                  "to run under context parallelism; use cp=1")
        setattr(module, "rope", GlobalRope(methods["rope_at"], positions))  # noqa: B010
        window = windows.get(name)
        core = (RingCore(ctx.cp_group, ctx.cp_size, ctx.cp_rank, window, documents, ctx.timeout_s) if comm == "ring"
                else GatheredCore(ctx.cp_group, ctx.cp_size, ctx.cp_rank, window, documents))
        setattr(module, "core", core)  # noqa: B010  (nn.Module.__setattr__ is typed for tensors and modules)
    return len(modules)


def check_context_parallel(model: nn.Module, cp: int, loss_fn: LossFn | None) -> None:
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
