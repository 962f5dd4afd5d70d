"""How a training step's tokens were spread over the experts: assignments per expert and dropped, per MoE layer.

Every expert-parallel layer counts the assignments it dispatches (``routed``: [E + 1], the kept assignments
to each expert, then the ones the capacity limit dropped). The ranks of a stage's dp·cp·tp plane dispatch
disjoint tokens (under expert TP only TP rank 0 counts, as every TP rank dispatches them all), and pipeline
stages hold different layers, so a sum over the world of every layer's counts is the global batch's.
``RoutingTally`` collects them after each forward of a pipeline chunk, beside the auxiliary loss; the step's
all-reduce of the loss carries them, and ``ExpertLoad`` says what a user watches: how much busier the
busiest expert is than the mean (1.0 balanced; E/k when every token goes to the same experts) and the share
of assignments dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from plait.experts.layer import ExpertParallelMoE
from plait.models.moe import pop_aux_losses


@dataclass
class ExpertLoad:
    """Assignments of one step's global batch, per MoE layer (in model order)."""

    layers: list[str]        # [layer]: the model layer each MoE layer is in ("3" for layers.3.mlp)
    counts: list[list[int]]  # [layer][expert]: assignments each expert ran
    dropped: list[int]       # [layer]: assignments dropped by the capacity limit (0 when dropless)
    aux_loss: float          # the load-balancing loss in the step's loss (coefficient included)
    capped: bool             # some layer has a capacity limit (it can drop assignments)

    def imbalance(self) -> list[float]:
        """Per layer, the busiest expert's assignments over the mean (1.0: perfectly balanced)."""
        return [max(c) * len(c) / sum(c) if sum(c) else 1.0 for c in self.counts]

    def dropped_fraction(self) -> float:
        """Dropped assignments over all assignments, every layer together."""
        total = sum(map(sum, self.counts)) + sum(self.dropped)
        return sum(self.dropped) / total if total else 0.0

    def row(self) -> dict:
        """A ``--metrics`` row's numbers: the auxiliary loss, the worst layer's and every layer's imbalance, and
        the share of assignments dropped (None when dropless)."""
        by_layer = self.imbalance()
        return {"aux_loss": self.aux_loss, "expert_imbalance": max(by_layer, default=1.0),
                "expert_imbalance_by_layer": dict(zip(self.layers, by_layer, strict=True)),
                "dropped_fraction": self.dropped_fraction() if self.capped else None}


class RoutingTally:
    """Sums the routing counts of one step's forwards, per MoE layer of the whole model, on this rank."""

    def __init__(self, model: nn.Module):
        """``model``: the whole (unsplit) model; numbers its expert-parallel layers in order."""
        named = [(path, m) for path, m in model.named_modules() if isinstance(m, ExpertParallelMoE)]
        layers = [m for _, m in named]
        # the model layer of each: the first number in its path (layers.3.mlp -> "3"), else the path
        self.names = [(re.findall(r"(?:^|\.)(\d+)(?:\.|$)", path) or [path])[0] for path, _ in named]
        self.n_experts = max((m.n_experts for m in layers), default=0)
        for i, m in enumerate(layers):
            m.layer_index = i
        self.n_layers = len(layers)
        self.capped = any(m.capacity_factor is not None for m in layers)
        # [n_layers, E + 1], made by ``start`` each step: a model's construction holds no more than its weights
        self.counts = torch.zeros(0, dtype=torch.float64)

    def start(self, device: torch.device) -> None:
        self.counts = torch.zeros(self.n_layers, self.n_experts + 1, dtype=torch.float64, device=device)

    def take(self, chunk: nn.Module) -> None:
        """Add and clear the counts the chunk's layers left on their last forward."""
        for m in chunk.modules():
            if isinstance(m, ExpertParallelMoE) and m.routed is not None:
                e = m.routed.numel() - 1
                self.counts[m.layer_index, :e] += m.routed[:e].to(self.counts)
                self.counts[m.layer_index, -1] += m.routed[e].to(self.counts)
                m.routed = None

    def aux_fn(self, scale: float):
        """The executor's per-chunk hook: takes the counts and returns the chunk's auxiliary loss times ``scale``."""
        def pop(chunk: nn.Module) -> torch.Tensor | None:
            self.take(chunk)
            aux = pop_aux_losses(chunk)
            return None if aux is None else aux * scale
        return pop

    def load(self, summed: list[float], aux_loss: float) -> ExpertLoad:
        """The step's ``ExpertLoad`` from the world's sum of ``counts`` (flattened)."""
        rows = torch.tensor(summed, dtype=torch.float64).view(self.n_layers, self.n_experts + 1).round().long()
        return ExpertLoad(layers=self.names, counts=rows[:, :-1].tolist(), dropped=rows[:, -1].tolist(),
                          aux_loss=aux_loss, capped=self.capped)
