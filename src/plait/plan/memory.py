"""Memory model: stage partition, mixed-precision Adam states with ZeRO, and activations (Korthikanti 2022)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from plait.plan.config import MAX_MEMORY_FRACTION, Cluster, Layout
from plait.plan.model import Model

# Mixed-precision Adam (Micikevicius et al. 2018; Rajbhandari et al. 2020, "ZeRO", §3.1):
# bf16 weights (2 B), fp32 gradient accumulators (4 B, Megatron's main_grad), fp32 master weights
# and two fp32 moments (12 B): 18 bytes per parameter. ZeRO-1 shards the 12, ZeRO-2 also the 4,
# ZeRO-3 also the 2, over the data-parallel (× context-parallel) group.
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 4, 12
# Share of a GPU's memory the planner lets a layout use by default (``Cluster.max_memory_fraction``): the rest
# is the CUDA context, NCCL buffers, the allocator's fragmentation and temporary buffers (workspace of GEMMs,
# gathered ZeRO-3 layers).
USABLE_FRACTION = MAX_MEMORY_FRACTION


@dataclass(frozen=True)
class Memory:
    """Bytes on the most loaded GPU (pipeline rank ``rank``), and what the planner lets it use."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    total: float
    rank: int
    usable: float

    @property
    def fits(self) -> bool:
        return self.total <= self.usable


def head_layers(model: Model) -> float:
    """The output head's forward FLOPs in units of one layer's (2hV vs the layer's, per token)."""
    return model.vocab * model.hidden / (model.layer_params(active=True) + 2 * model.seq_len * model.hidden)


@lru_cache(maxsize=4096)
def _partition(n_layers: int, pp: int, head: float) -> tuple[int, ...]:
    extra = [0.0] * (pp - 1) + [head]
    if pp == 1:
        return (n_layers,)
    candidates = sorted({k + e for k in range(1, n_layers + 1) for e in (0.0, head)})
    for target in candidates:  # smallest feasible max(stage layers + head share)
        caps = [int(target - e + 1e-9) for e in extra]
        if min(caps) >= 1 and sum(caps) >= n_layers:
            break
    over = sum(caps) - n_layers
    for i in range(pp):  # take surplus layers off the first stages: they hold the most activations
        cut = min(over, caps[i] - 1)
        caps[i] -= cut
        over -= cut
    return tuple(caps)


def stage_layers(model: Model, pp: int) -> tuple[int, ...]:
    """Layers per pipeline rank, balancing compute with the head on the last rank.

    Balancing by layer count alone is wrong: the head of a 128k-vocabulary model costs
    more than two layers of Llama 3 8B. Surplus layers are removed from the first ranks, which hold
    the embedding and the most activations (what Llama 3 405B did: Dubey et al. 2024, §3.3.2).
    """
    return _partition(model.n_layers, pp, round(head_layers(model), 2))


def activation_bytes_per_layer(model: Model, layout: Layout, micro: int | None = None) -> float:
    """Activation bytes one layer stores for one micro-batch (Korthikanti et al. 2022, §4).

    The paper's per-layer count for GPT (MHA, 4h GELU MLP, 16-bit, dropout) is
    ``sbh(34 + 5as/h)`` without parallelism, ``sbh(10 + 24/t + 5as/(ht))`` with TP and
    ``sbh(34/t + 5as/(ht))`` with TP+SP. Its terms, generalised to GQA (g = kv/heads) and GLU MLPs:
    replicated 10 = 2 norm inputs (4) + QKV and MLP inputs (4) + 2 dropout masks (2); TP-sharded
    attention 4 + 4g (Q, K, V, projection input), MLP 2·(f/h)·k (k = 2 GELU tensors, 3 for GLU);
    score term 5as/h. Selective recomputation drops 5as/h; full keeps the 2sbh layer input.
    """
    b = micro or layout.microbatch_size
    s, h, t = model.seq_len / layout.cp, model.hidden, layout.tp
    g = model.kv_heads / model.n_heads
    k = 3 if model.glu else 2
    mlp = 2 * (model.ffn / h) * k * (model.top_k if model.is_moe else 1)
    sharded = 4 + 4 * g + mlp
    replicated = 10.0
    score = 5 * model.n_heads * model.seq_len / h  # s·s/cp for the local queries against all keys
    sbh = s * b * h
    if layout.recompute == "full":
        return 2 * sbh / (t if layout.sequence_parallel else 1)
    body = (replicated + sharded) / t if layout.sequence_parallel else replicated + sharded / t
    if layout.recompute == "none":
        body += score / t
    return sbh * body


def _rank_params(model: Model, layout: Layout, layers: int, first: bool, last: bool) -> tuple[float, float]:
    """(dense, expert) parameters held by one GPU of a pipeline rank with ``layers`` layers."""
    t = layout.tp
    expert_layer = model.n_experts * model.mlp_params() if model.is_moe else 0
    dense = layers * (model.layer_params() - expert_layer) / t
    if first:
        dense += model.embedding_params() / t
    if last:
        dense += model.head_params() / t
        if model.tied_embeddings and layout.pp > 1:
            dense += model.vocab * model.hidden / t  # the last stage keeps its own copy for the head
    return dense, layers * expert_layer / (t * layout.ep)


def state_bytes(model: Model, layout: Layout, layers: int, first: bool, last: bool) -> tuple[float, ...]:
    """(weights, grads, optimizer) bytes of one GPU, with ZeRO sharding over dp·cp."""
    dense, expert = _rank_params(model, layout, layers, first, last)
    group = layout.dp * layout.cp
    eg = group // layout.ep if model.is_moe else 1

    def shard(stage: int) -> float:
        return dense / group + expert / eg if layout.zero >= stage else dense + expert

    return WEIGHT_BYTES * shard(3), GRAD_BYTES * shard(2), OPTIMIZER_BYTES * shard(1)


def extra_activation_bytes(model: Model, layout: Layout, first: bool, last: bool, in_flight: float) -> float:
    """First stage: the embedding's dropout mask sbh per micro-batch in flight; last stage: the
    output layer and loss, 4sbh/t·(1 + V/h) for one micro-batch (Korthikanti et al. 2022, §4.3)."""
    s, b, h, t = model.seq_len / layout.cp, layout.microbatch_size, model.hidden, layout.tp
    out = 0.0
    if first:
        out += s * b * h * in_flight / (t if layout.sequence_parallel else 1)
    if last:
        out += 4 * s * b * h / t * (1 + model.vocab / h)
    return out


def memory(model: Model, cluster: Cluster, layout: Layout, in_flight: list[float]) -> Memory:
    """Memory of the most loaded GPU; ``in_flight[r]`` is the simulator's peak micro-batches of rank r."""
    layers = stage_layers(model, layout.pp)
    per_layer = activation_bytes_per_layer(model, layout)
    working = 0.0
    if layout.zero == 3:  # two gathered layers in flight (the current one and the prefetched next)
        working += 2 * WEIGHT_BYTES * model.layer_params() / (layout.tp * layout.ep)
    if layout.recompute == "full":  # the layer being recomputed holds its full (selective) set once
        working += activation_bytes_per_layer(model, Layout(**{**_fields(layout), "recompute": "selective"}))
    last = layout.pp - 1
    ranks = {0, last, min(1, last), max(range(layout.pp), key=lambda r: in_flight[r])}
    best: Memory | None = None
    for r in sorted(ranks):
        w, g, o = state_bytes(model, layout, layers[r], r == 0, r == last)
        act = in_flight[r] * layers[r] * per_layer + working
        act += extra_activation_bytes(model, layout, r == 0, r == last, in_flight[r])
        total = w + g + o + act
        if best is None or total > best.total:
            best = Memory(w, g, o, act, total, r, cluster.usable_memory)
    assert best is not None
    return best


def _fields(layout: Layout) -> dict:
    return {k: getattr(layout, k) for k in layout.__dataclass_fields__}
