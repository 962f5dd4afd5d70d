"""The check that every rank of a data-parallel replica was handed the same batch.

The ranks of one replica (its TP, CP and pipeline ranks) each run part of the same rows: TP ranks combine partial
results of them, the last stage's targets meet the first stage's inputs. Handed different rows (a batch split by
``ctx.rank`` instead of ``ctx.dp_rank``, or each rank drawing its own), they would train on a mixture that matches
no batch, and say nothing; handed different shapes, they would fail mid-step in a collective or a kernel.
"""

from __future__ import annotations

import torch

from plait.distributed.collectives import all_gather_tensor, collective
from plait.distributed.context import ParallelContext
from plait.errors import ConfigError

DIMS = 4  # the dimensions of a tensor's shape the fingerprint names (more: only their product counts)
WIDTH = DIMS + 4  # numbers in one tensor's fingerprint


def fingerprint(x: torch.Tensor | None) -> list[float]:
    """Shape and contents of ``x`` in ``WIDTH`` numbers (all -1 for None): its number of dimensions, the first
    ``DIMS`` sizes (0 past its last), its element count, its sum and a sum weighted by position (which tells rows in
    another order apart), in float64; a NaN sum reads as inf, so that equal contents give equal numbers."""
    if x is None:
        return [-1.0] * WIDTH
    shape = list(x.shape[:DIMS]) + [0] * (DIMS - min(x.dim(), DIMS))
    flat = x.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    sums = torch.stack([flat.sum(), (flat * weights).sum()]).nan_to_num(nan=float("inf")).tolist()
    return [float(x.dim()), *map(float, shape), float(x.numel()), *sums]


#: what check_same_batch's error advises by default: a training or evaluation batch
ROWS = ("batches", ("inputs", "targets"), "every rank of a replica (its tp, cp and pipeline ranks) takes the same "
        "rows; split the global batch by ctx.dp_rank, e.g. batch.chunk(ctx.dp_size)[ctx.dp_rank], not by ctx.rank")


def check_same_batch(ctx: ParallelContext, inputs: torch.Tensor, targets: torch.Tensor | None,
                     words: tuple[str, tuple[str, str], str] = ROWS) -> None:
    """ConfigError on every rank if two ranks of one replica were handed different inputs or targets (one
    all-gather of a few numbers over the world); nothing to compare when each replica is one rank. ``words``:
    what the two tensors are, together and each, and the advice, for the error."""
    if ctx.world_size == ctx.dp_size:
        return
    mine = torch.tensor(fingerprint(inputs) + fingerprint(targets), dtype=torch.float64, device=ctx.device)
    every = torch.empty(ctx.world_size * mine.numel(), dtype=torch.float64, device=ctx.device)
    collective("all-gather of the ranks' batch fingerprints", None, lambda: all_gather_tensor(every, mine))
    rows = every.view(ctx.world_size, -1).tolist()  # one host read
    for replica in range(ctx.dp_size):
        ranks = ctx.replica_ranks(replica)
        differ = [g for g in ranks if rows[g] != rows[ranks[0]]]
        if differ:
            what, names, advice = words
            raise ConfigError(
                f"the ranks of data-parallel replica {replica} were handed different {what} (global rank {ranks[0]}: "
                f"{_words(rows[ranks[0]], names)}; global rank {differ[0]}: {_words(rows[differ[0]], names)}): "
                f"{advice}")


def _words(row: list[float], names: tuple[str, str]) -> str:
    """A rank's fingerprints in words: each tensor's shape and sum."""
    said = []
    for name, part in zip(names, (row[:WIDTH], row[WIDTH:]), strict=True):
        if part[0] >= 0:
            dims = int(part[0])
            shape = tuple(int(d) for d in part[1:1 + dims]) if dims <= DIMS else f"{dims} dimensions"
            said.append(f"{name} {shape} summing to {part[DIMS + 2]:.17g}")
    return ", ".join(said)
