"""The mixture-of-experts load-balancing loss of sequences whose tokens are split over the CP group."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from plait.distributed.collectives import collective


def split_sequence_aux_loss(logits: torch.Tensor, expert: torch.Tensor, coef: float, group: ProcessGroup | None,
                            cp: int) -> torch.Tensor:
    """This rank's share of coef · Σ_sequences E · Σ_i f_i · P_i (plait.models.moe; Fedus et al. 2021 eq. 4).

    logits [B, S/cp, E] (router), expert [B, S/cp, k] (chosen ids) of this rank's tokens. f_i counts the
    whole sequence's assignments (all-reduced over the CP group; no gradient, as in the paper); P_i's mean
    over the S tokens is split into the ranks' partial sums, so the shares summed over the CP group are the
    loss of the whole sequences, and so are their gradients.
    """
    b, s, k = expert.shape
    n_experts, length = logits.shape[-1], s * cp
    counts = F.one_hot(expert, n_experts).sum((1, 2)).float()  # [B, E] this rank's assignments
    collective("cp all-reduce of expert counts", group, lambda: dist.all_reduce(counts, group=group))
    f = counts / (length * k)
    p_part = logits.float().softmax(-1).sum(1) / length  # [B, E]
    return coef * n_experts * (f * p_part).sum()
