"""Dropless token dispatch to expert-parallel ranks and combine back (sort, all-to-all, run, return).

With E experts over an EP group of size ep, rank r owns experts [r·E/ep, (r+1)·E/ep). For n local
tokens routed to k experts each:
  1. sort the n·k (kept) assignments by expert id; per-expert counts [E] give the send split per rank;
  2. exchange the counts (all-to-all of [E] ints), then the token rows (variable all-to-all);
  3. the received rows arrive grouped by source rank, then by our local expert: regroup by expert,
     run each local expert on its contiguous rows, restore the arrival order;
  4. all-to-all the results back, and sum them into their tokens weighted by the gates.
Every step is differentiable (index ops and ``experts.comms.all_to_all``), so backward sends output
gradients to the experts' ranks and input gradients home through the same two exchanges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from plait.experts.comms import all_to_all, exchange_counts


@dataclass
class Plan:
    """Split sizes of one dispatch (Python ints, needed by the collectives)."""

    send: list[int]            # rows we send to each EP rank
    recv: list[int]            # rows we receive from each EP rank
    recv_counts: torch.Tensor  # [ep, E_local]: rows from each rank for each of our experts


def sort_assignments(expert: torch.Tensor, gate: torch.Tensor, keep: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kept (token, gate) assignments sorted by expert: expert [n, k] -> (expert ids, token ids, gates) [A]."""
    n, k = expert.shape
    token = torch.arange(n, device=expert.device).repeat_interleave(k)  # [n·k]
    chosen = keep.reshape(-1)
    e, t, g = expert.reshape(-1)[chosen], token[chosen], gate.reshape(-1)[chosen]
    order = torch.argsort(e, stable=True)
    return e[order], t[order], g[order]


def make_plan(expert_sorted: torch.Tensor, n_experts: int, ep: int, group) -> Plan:
    """Per-rank split sizes; with ep > 1 the counts are exchanged (one small all-to-all)."""
    counts = torch.bincount(expert_sorted, minlength=n_experts)  # [E]
    if ep == 1:
        return Plan(send=[int(counts.sum())], recv=[int(counts.sum())], recv_counts=counts.view(1, -1))
    recv_counts = exchange_counts(counts, group)  # [ep, E/ep]
    send = counts.view(ep, -1).sum(1).tolist()
    return Plan(send=send, recv=recv_counts.sum(1).tolist(), recv_counts=recv_counts)


def run_local_experts(rows: torch.Tensor, recv_counts: torch.Tensor, experts: Sequence[nn.Module]
                      ) -> torch.Tensor:
    """Apply local expert j to its rows; ``rows`` [R, H] arrive grouped (source rank, local expert)."""
    ep, n_local = recv_counts.shape
    per_expert = recv_counts.sum(0).tolist()  # [E_local]
    if ep > 1:  # regroup by expert: label each row, stable sort
        labels = torch.arange(n_local, device=rows.device).repeat(ep)
        labels = labels.repeat_interleave(recv_counts.reshape(-1))  # [R]
        order = torch.argsort(labels, stable=True)
        rows = rows[order]
    outs = [expert(part) for expert, part in zip(experts, rows.split(per_expert), strict=True)]
    out = torch.cat(outs) if outs else rows
    if ep > 1:
        out = out[torch.argsort(order)]  # back to arrival order
    return out  # [R, H]


def count_routing(expert: torch.Tensor, keep: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[E + 1] int64: kept assignments per expert of ``expert``/``keep`` [n, k], then the dropped ones."""
    kept = torch.bincount(expert[keep], minlength=n_experts)
    return torch.cat([kept, (~keep).sum().view(1)])


def dispatch_combine(x: torch.Tensor, expert: torch.Tensor, gate: torch.Tensor, keep: torch.Tensor,
                     experts: Sequence[nn.Module], n_experts: int, ep: int, group) -> torch.Tensor:
    """Mixture-of-experts output for tokens x [n, H] routed by expert/gate/keep [n, k]; local experts only."""
    e_sorted, token, g = sort_assignments(expert, gate, keep)  # [A]
    plan = make_plan(e_sorted, n_experts, ep, group)
    rows = x[token]  # [A, H] grouped by destination rank
    if ep > 1:
        rows = all_to_all(rows, plan.recv, plan.send, group)  # [R, H]
    rows = run_local_experts(rows, plan.recv_counts, experts)
    if ep > 1:
        rows = all_to_all(rows, plan.send, plan.recv, group)  # [A, H] back home, same order
    return torch.zeros_like(x).index_add(0, token, rows * g.unsqueeze(-1))  # [n, H]
