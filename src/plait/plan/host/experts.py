"""What one mixture-of-experts layer of plait's eager runtime saves for backward beyond the dense MLP's count.

``plait.experts.layer.ExpertParallelMoE`` with its dispatch (``plait.experts.dispatch``), per rank and per
micro-batch, in the census's sizes (``census.Local``): ``T`` tokens (the full sequences: the router runs
replicated over TP, on the SP gather's output under SP), ``B = T/s`` sequences, ``E`` experts, top-k ``k``, ``h``
the hidden size. A rank dispatches ``D`` tokens: ``T/t`` with whole experts at tp > 1 (its slice of the
flattened tokens, or its sequence shard under SP), all ``T`` with experts split over TP or at tp = 1; it sends
``A = D·k`` rows and, with balanced routing (every expert receives the same number of rows from every rank),
receives ``R = A``: the census counts balanced routing, where ``R`` is the one size that depends on the routing
(a rank whose experts receive more rows keeps more). Dropless, or with a capacity factor of at least 1, which
balanced routing never exceeds, so no assignment is dropped. ``Local.received`` scales ``R`` (and the experts'
``4 F``) to count an uneven routing's busiest rank (``plan.experts.received``, ``Model.expert_capacity``).

Saved (what ``torch.autograd.graph.saved_tensors_hooks`` sees, each storage once):
* router: its input (the norm's scaled output, or under SP the whole gathered copy, where a dense MLP's
  projections keep the shard without full recomputation: counted with the norm, ``census.layer_saved``); the
  float32 softmax ``[T, E]``, top-k's int64 indices ``[T, k]``; with k > 1 the top-k probabilities ``[T, k]``
  and their sums ``[T, 1]`` that renormalise them (float32); the load-balancing loss's assignment fractions
  ``[B, E]`` (float32); under context parallelism its split loss (``context_parallel.routing``) takes a softmax
  of its own ``[T, E]`` (float32);
* whole experts at tp > 1: the int64 indices of the rank's tokens (``_my_tokens``): a slice of an arange of
  all ``T`` (its storage counts), or under SP the ``D`` positions of its shard;
* dispatch: the kept-assignment mask ``[D·k]`` (bool), the sort order and the token index of each assignment
  ``[A]`` (int64; ``index_add`` saves the same token index), the sorted gates ``[A]``; with ep > 1 the
  regrouping order of the received rows and its inverse ``[R]`` (int64);
* the experts' input rows ``[R, h]`` (each expert's linears keep their slice of the one buffer), and in each
  expert what the dense SwiGLU keeps: ``4·R·f`` over a rank's experts at their width ``f`` (whole) or ``f/t``
  (split): ``4 F`` either way, in the dense count;
* combine: the experts' outputs back in the rank's order ``[A, h]`` (the product with the gates keeps them)
  and that product ``[A, h]`` (``index_add`` keeps its source).

Whole and split experts differ in ``D``: a TP rank of split experts dispatches, and keeps the rows of, all the
tokens (t times the whole experts' rows), and keeps no token slice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait.plan.host.census import Local


def dispatched(sh: Local) -> float:
    """``D``: the tokens a rank dispatches (the module docstring)."""
    return sh.tokens if sh.expert_split or sh.tp == 1 else sh.tokens / sh.tp


def moe_saved(sh: Local, dtype_bytes: int = 4) -> float:
    """Elements (of ``dtype_bytes`` each) one MoE layer saves per micro-batch beyond its input and the ``4 F``
    of a dense MLP of width ``sh.ffn``; 0 for a dense layer. ``R`` at ``sh.received`` times balanced routing's
    (the module docstring)."""
    if sh.experts <= 1:
        return 0.0
    fp32, i64, b1 = 4 / dtype_bytes, 8 / dtype_bytes, 1 / dtype_bytes
    t, e, k = sh.tokens, sh.experts, sh.top_k
    router = t * e * fp32 + t * k * i64 + t / sh.seq * e * fp32
    if k > 1:
        router += (t * k + t) * fp32
    if sh.cp > 1:
        router += t * e * fp32
    d = dispatched(sh)
    mine = 0.0 if d == t else (d if sh.sp else t) * i64
    a = d * sh.top_k
    rows = a * sh.received  # R = A with balanced routing
    dispatch = a * b1 + 2 * a * i64 + a + (2 * rows * i64 if sh.ep > 1 else 0.0)
    return router + mine + dispatch + rows * sh.hidden + 2 * a * sh.hidden
