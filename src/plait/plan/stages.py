"""Pipeline chunks of a model under a layout: the runtime's cut (``pipeline.balance``) and its placement."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from plait.pipeline.balance import embedding_macs, head_macs, layer_macs, partition_layers
from plait.plan.config import V_SCHEDULES, Layout
from plait.plan.model import Model
from plait.schedules import loop_placement, v_placement


@dataclass(frozen=True)
class Stages:
    """``chunk_layers[c]`` decoder layers in chunk ``c``, held by rank ``placement[c]``; the embedding
    joins chunk 0 and the final norm + head (+ loss) the last chunk, wherever they are placed."""

    chunk_layers: tuple[int, ...]
    placement: tuple[int, ...]
    ranks: int

    @property
    def virtual(self) -> int:
        return len(self.chunk_layers) // self.ranks

    @property
    def first_rank(self) -> int:
        return self.placement[0]

    @property
    def last_rank(self) -> int:
        return self.placement[-1]

    @cached_property
    def rank_layers(self) -> tuple[int, ...]:
        """Decoder layers per pipeline rank (the sum of its chunks)."""
        out = [0] * self.ranks
        for c, n in enumerate(self.chunk_layers):
            out[self.placement[c]] += n
        return tuple(out)

    @cached_property
    def first_chunk(self) -> tuple[int, ...]:
        """The lowest chunk index of each rank."""
        out = [len(self.placement)] * self.ranks
        for c, r in enumerate(self.placement):
            out[r] = min(out[r], c)
        return tuple(out)


def placement(schedule: str, pp: int, virtual: int) -> tuple[int, ...]:
    """The chunk -> rank map ``build_schedule`` uses: a V for zbv/dualpipev, round-robin otherwise."""
    return v_placement(pp) if schedule in V_SCHEDULES else loop_placement(pp, virtual)


def partition_costs(model: Model) -> tuple[float, float, float]:
    """(cost of one layer, of the embedding, of the head) per token, as ``pipeline.partition`` counts a
    Llama: matmul weights a token uses plus QKᵀ and AV, at the sequence length the runtime balances for."""
    matmul = model.layer_params(active=True) - model.layer_norm_params()
    seq = model.balance_seq_len or model.seq_len
    return layer_macs(matmul, seq, model.hidden), embedding_macs(model.hidden), head_macs(model.vocab,
                                                                                          model.hidden)


@lru_cache(maxsize=4096)
def stages(model: Model, pp: int, virtual: int = 1, schedule: str = "1f1b",
           partition: str | tuple[int, ...] = "balanced") -> Stages:
    """The chunks the runtime builds for ``pp`` ranks × ``virtual`` chunks under ``partition``
    (``Layout.partition``; "balanced", the runtime's default, charges the embedding and the head)."""
    layer, first, last = partition_costs(model)
    k = pp * virtual
    counts = partition_layers(model.n_layers, k, partition, [layer] * model.n_layers, first, last)
    return Stages(tuple(counts), placement(schedule, pp, virtual), pp)


def layout_stages(model: Model, layout: Layout) -> Stages:
    """``stages`` of ``layout``'s pipeline."""
    return stages(model, layout.pp, layout.virtual_stages, layout.schedule, layout.partition)
