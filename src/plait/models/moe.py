"""A plain mixture-of-experts feed-forward (softmax top-k router, SwiGLU experts, load-balancing loss).

Routing is computed per *sequence* (one routing group = one sequence of the batch, as GShard's groups,
Lepikhin et al. 2020 §2.2): the auxiliary loss and the optional expert capacity only look at the tokens
of one sequence. Sequences are never split by micro-batching or data parallelism, and the parallel
version routes full sequences too, so every layout gives exactly the single-device result.

Router: p = softmax(x W_r^T) over E experts; each token goes to its top-k experts. With k = 1 the gate
is the raw probability (Switch, Fedus et al. 2021 eq. 1-2); with k > 1 the k probabilities are
renormalised to sum to one (Mixtral, Jiang et al. 2024).

Capacity (``capacity_factor`` = c, optional): expert i accepts at most C = ceil(c·S·k/E) assignments of
one sequence; assignments are served in GShard's priority order (every token's first choice in position
order, then every second choice, ...) and the rest are *dropped*: that expert contributes nothing and the
token continues through the residual connection (Fedus et al. 2021 §2.2). ``None`` = dropless.

Load-balancing loss of one sequence (Fedus et al. 2021 eq. 4, top-k form as in GShard):
    aux_s = E · Σ_i f_i · P_i,   f_i = (assignments to i) / (S·k),   P_i = mean_t p_{t,i}
(1 under perfectly uniform routing). A layer stores ``aux_loss = coef · Σ_s aux_s`` (a sum over its
sequences); the model's loss adds Σ_layers aux_loss / (number of sequences), i.e. the batch mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import ConfigError


class Expert(nn.Module):
    """One SwiGLU expert (Shazeer 2020): down(silu(gate(x)) * up(x)); same names as Llama's MLP."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class Routing:
    """Where each token of a [B, S] batch goes."""

    expert: torch.Tensor  # [B, S, k] int64 expert ids
    gate: torch.Tensor    # [B, S, k] combine weights
    keep: torch.Tensor    # [B, S, k] bool, False = dropped by the capacity limit
    aux: torch.Tensor     # [] coef · Σ_sequences aux_s


def capacity_keep(expert: torch.Tensor, n_experts: int, capacity_factor: float | None) -> torch.Tensor:
    """Mask of the assignments each expert accepts within one sequence (GShard priority order)."""
    b, s, k = expert.shape
    if capacity_factor is None:
        return torch.ones_like(expert, dtype=torch.bool)
    cap = math.ceil(capacity_factor * s * k / n_experts)
    order = expert.transpose(1, 2).reshape(b, k * s)  # [B, k·S]: all first choices, then second, ...
    onehot = F.one_hot(order, n_experts)  # [B, k·S, E]
    position = (onehot.cumsum(1) * onehot).sum(-1) - 1  # [B, k·S]: place in its expert's queue
    return (position < cap).view(b, k, s).transpose(1, 2)  # [B, S, k]


def load_balancing_loss(probs: torch.Tensor, expert: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Σ over sequences of E · Σ_i f_i · P_i (Fedus et al. 2021 eq. 4); probs [B, S, E], expert [B, S, k]."""
    b, s, k = expert.shape
    counts = F.one_hot(expert, n_experts).sum((1, 2)).to(probs.dtype)  # [B, E]
    f = counts / (s * k)  # [B, E] fraction of assignments (no gradient, as in the paper)
    p_mean = probs.mean(1)  # [B, E]
    return n_experts * (f * p_mean).sum()


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None, aux_coef: float) -> Routing:
    """Softmax top-k routing of router logits [B, S, E] (computed in float32)."""
    n_experts = logits.shape[-1]
    probs = logits.float().softmax(-1)  # [B, S, E]
    gate, expert = probs.topk(top_k, dim=-1)  # [B, S, k]
    if top_k > 1:
        gate = gate / gate.sum(-1, keepdim=True)
    keep = capacity_keep(expert, n_experts, capacity_factor)
    aux = aux_coef * load_balancing_loss(probs, expert, n_experts)
    return Routing(expert=expert, gate=gate.to(logits.dtype), keep=keep, aux=aux)


class MoE(nn.Module):
    """Mixture-of-experts feed-forward: x [B, S, H] -> [B, S, H]; sets ``aux_loss`` on every forward."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int, top_k: int = 2,
                 capacity_factor: float | None = None, aux_loss_coef: float = 0.01):
        super().__init__()
        check_routing(n_experts, top_k, capacity_factor, aux_loss_coef)
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor, self.aux_loss_coef = capacity_factor, aux_loss_coef
        self.gate = nn.Linear(dim, n_experts, bias=False)  # the router (Mixtral's name)
        self.experts = nn.ModuleList(Expert(dim, ffn_dim) for _ in range(n_experts))
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, S, H]
        r = route(self.gate(x), self.top_k, self.capacity_factor, self.aux_loss_coef)
        self.aux_loss = r.aux
        flat = x.flatten(0, 1)  # [N, H]
        expert, gate = r.expert.flatten(0, 1), r.gate.flatten(0, 1)  # [N, k]
        chosen = r.keep.flatten(0, 1)
        out = torch.zeros_like(flat)
        for i, module in enumerate(self.experts):  # every expert runs (maybe on no tokens): grads exist
            token, slot = torch.nonzero((expert == i) & chosen, as_tuple=True)
            y = module(flat[token]) * gate[token, slot].unsqueeze(-1)  # [n_i, H]
            out = out.index_add(0, token, y)
        return out.view_as(x)


def pop_aux_losses(module: nn.Module) -> torch.Tensor | None:
    """Sum and clear the ``aux_loss`` left by submodules' last forward (None if there is none)."""
    total = None
    for sub in module.modules():
        aux = getattr(sub, "aux_loss", None)
        if isinstance(aux, torch.Tensor):
            total = aux if total is None else total + aux
            setattr(sub, "aux_loss", None)  # noqa: B010 (any module may hold one)
    return total


def has_aux_losses(module: nn.Module) -> bool:
    """Whether any submodule produces an auxiliary loss (a mixture-of-experts layer)."""
    return any(hasattr(sub, "aux_loss") for sub in module.modules())


def check_moe_config(cfg) -> None:
    """ConfigError for inconsistent mixture-of-experts fields of a model config."""
    if cfg.n_experts < 1 or cfg.moe_every < 1:
        raise ConfigError(f"n_experts={cfg.n_experts}, moe_every={cfg.moe_every}: both must be >= 1")
    check_routing(cfg.n_experts, cfg.top_k, cfg.capacity_factor, cfg.aux_loss_coef)


def check_routing(n_experts: int, top_k: int, capacity_factor: float | None, aux_loss_coef: float) -> None:
    """ConfigError naming the first routing setting out of range (a top_k of 0 would route nothing)."""
    if n_experts < 1:
        raise ConfigError(f"n_experts={n_experts} must be >= 1")
    if not 1 <= top_k <= n_experts:
        raise ConfigError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ConfigError(f"capacity_factor={capacity_factor} must be positive (or None: dropless)")
    if aux_loss_coef < 0:
        raise ConfigError(f"aux_loss_coef={aux_loss_coef} must be >= 0")
