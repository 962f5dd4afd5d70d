"""Which global ranks form a data-parallel replica (ParallelContext.replica_ranks), and the check that every rank
of a replica was handed the same batch naming them (plait.distributed.same_batch), in one process: the world's
fingerprints are handed to the check instead of all-gathered."""

from __future__ import annotations

import pytest
import torch

from plait.distributed import same_batch
from plait.distributed.context import ParallelContext
from plait.errors import ConfigError
from plait.parallel_config import ParallelConfig

LAYOUTS = [dict(tp=2, pp=2, dp=2), dict(cp=2, pp=2, dp=2), dict(tp=2, cp=2, dp=2), dict(dp=4), dict(tp=2, pp=2)]


def _contexts(layout: dict) -> list[ParallelContext]:
    """A context of every rank of ``layout``'s world (coordinates only: no process group)."""
    world = layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1) * layout.get("dp", 1)
    config = ParallelConfig(**layout).resolve(world)
    return [ParallelContext(config=config, rank=r, world_size=world, device=torch.device("cpu")) for r in range(world)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_replica_ranks_are_the_ranks_with_that_dp_rank(layout):
    ctxs = _contexts(layout)
    replicas = [ctxs[0].replica_ranks(d) for d in range(ctxs[0].dp_size)]
    for d, ranks in enumerate(replicas):
        assert ranks == [c.rank for c in ctxs if c.dp_rank == d]
    assert sorted(r for ranks in replicas for r in ranks) == list(range(len(ctxs)))
    assert all(ctx.replica_ranks(d) == replicas[d] for ctx in ctxs for d in range(len(replicas)))  # alike everywhere


@pytest.mark.parametrize("layout", LAYOUTS[:3], ids=str)
def test_a_rank_handed_other_rows_than_its_replica_is_named_with_the_replica(monkeypatch, layout):
    """Replicas may see different rows; inside one, the first rank of the replica whose rows differ from its first
    rank's is named, beside that first rank and the replica's index."""
    ctxs = _contexts(layout)
    world, last = len(ctxs), ctxs[0].dp_size - 1
    ranks = [c.rank for c in ctxs if c.dp_rank == last]
    rows = {r: torch.arange(6.0).view(2, 3) + ctxs[r].dp_rank for r in range(world)}  # each replica its own rows
    odd = ranks[-1]
    rows[odd] = rows[odd].flip(0)  # the same numbers in another order
    prints = torch.tensor([same_batch.fingerprint(rows[r]) + same_batch.fingerprint(None) for r in range(world)],
                          dtype=torch.float64)
    monkeypatch.setattr(same_batch, "all_gather_tensor", lambda every, mine: every.copy_(prints.reshape(-1)))
    total = f"{float(rows[odd].sum()):.17g}"
    with pytest.raises(ConfigError, match=rf"replica {last} were handed different batches \(global rank {ranks[0]}: "
                                          rf"inputs \(2, 3\) summing to {total}; global rank {odd}: inputs \(2, 3\)"):
        same_batch.check_same_batch(ctxs[0], rows[0], None)
    rows[odd] = rows[odd].flip(0)
    prints = torch.tensor([same_batch.fingerprint(rows[r]) + same_batch.fingerprint(None) for r in range(world)],
                          dtype=torch.float64)
    same_batch.check_same_batch(ctxs[0], rows[0], None)  # replicas differ, each replica's ranks agree
