"""Which tokens of a sequence each context-parallel rank holds (the causal load balance), and the masks.

A sequence of S tokens is cut into 2·cp chunks of c = S/(2·cp); CP rank r keeps chunks r and 2·cp-1-r
(the "zigzag" layout of Megatron-LM's context parallelism and of Brandon et al. 2023, "Striped
Attention"'s load-balancing argument): under a causal mask the query at position p attends to p+1 keys,
so chunk r's queries see r·c + (c+1)/2 keys on average and chunk 2·cp-1-r's (2·cp-1-r)·c + (c+1)/2 — a
sum that is the same, (2·cp-1)·c + c + 1, for every r. Each rank thus does the same attention work
(``attention_pairs``), while a plain contiguous cut would leave the last rank cp times the first's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from plait.distributed.collectives import collective
from plait.parallel_config import cp_chunks


def local_positions(local_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions [S/cp] of the ``local_len`` tokens CP rank ``rank`` holds: chunks r and 2·cp-1-r."""
    return torch.cat([torch.arange(r.start, r.stop, device=device) for r in cp_chunks(local_len, cp, rank)])


def gathered_positions(local_len: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions [S] of the tokens of an all-gather over the CP group (rank 0's, then rank 1's, ...)."""
    return torch.cat([local_positions(local_len, cp, r, device) for r in range(cp)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of full rows ``x`` (``[B, S, ...]`` -> ``[B, S/cp, ...]`` for dim 1)."""
    if cp == 1:
        return x
    pos = local_positions(x.shape[dim] // cp, cp, rank, x.device)
    return x.index_select(dim, pos)


def gather_sequence(x: torch.Tensor, group: ProcessGroup | None, cp: int, dim: int = 1) -> torch.Tensor:
    """Full rows in position order from every CP rank's tokens (``[B, S/cp, ...]`` -> ``[B, S, ...]``); no
    autograd (evaluation)."""
    if cp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(cp)]
    collective("cp all-gather of the sequence", group, lambda: dist.all_gather(parts, x.contiguous(), group=group))
    order = torch.argsort(gathered_positions(x.shape[dim], cp, x.device))
    return torch.cat(parts, dim=dim).index_select(dim, order)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[Sq, Sk] bool, True where the query at ``q_pos`` sees the key at ``k_pos``: k <= q, and q - W < k with a
    sliding window W (as plait.models.llama.window_mask, for keys at any positions)."""
    seen = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    return seen


def sees(q_rank: int, k_rank: int, local_len: int, cp: int, window: int | None) -> bool:
    """Whether any query CP rank ``q_rank`` holds sees any key CP rank ``k_rank`` holds (``causal_mask``'s rule),
    from the ranks' chunks alone: a chunk of queries [qa, qb] sees a chunk of keys [ka, kb] iff ka <= qb and, with a
    window W, kb > qa - W. Without a window a rank sees every rank's block (its early chunk sees the later rank's
    late chunk); with one shorter than a chunk, only its neighbours' and its own."""
    c = local_len // 2

    def chunks(rank: int) -> tuple[int, int]:
        return rank, 2 * cp - 1 - rank

    return any(ka * c <= (qa + 1) * c - 1 and (window is None or (ka + 1) * c - 1 > qa * c - window)
               for qa in chunks(q_rank) for ka in chunks(k_rank))


def attention_pairs(seq_len: int, cp: int, window: int | None = None) -> list[int]:
    """Query-key pairs each CP rank's attention computes (unmasked entries of its rows of the causal mask)."""
    local = seq_len // cp
    keys = torch.arange(seq_len)
    return [int(causal_mask(local_positions(local, cp, r), keys, window).sum()) for r in range(cp)]
