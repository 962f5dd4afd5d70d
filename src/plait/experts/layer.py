"""Expert parallelism applied from outside: a plain ``MoE`` becomes an ``ExpertParallelMoE`` over the EP group.

Where EP lives (``ParallelContext``): within one pipeline stage, the dp·cp·tp ranks form a plane indexed
q = (dp_rank·cp + cp_rank)·tp + tp_rank; EP groups are runs of ``ep`` consecutive q (so an EP group is a TP
group, part of one, or several whole TP groups of neighbouring CP or DP ranks), ep_rank = q mod ep, and
rank ep_rank owns experts [ep_rank·E/ep, (ep_rank+1)·E/ep). Ranks with the same ep_rank (the expert-data-
parallel group, dp·cp·tp/ep ranks) hold the same experts: expert gradients are summed over that group
instead of the dp×cp group. Under context parallelism each rank routes its part of every sequence; the
load-balancing loss then counts the whole sequence's assignments (plait.context_parallel.routing).

Token ownership: every rank of the plane dispatches a disjoint set of tokens. Under TP the layer enters
the TP region like the dense MLP (f, or the sequence all-gather with SP), routes the full sequences
(replicated, so routing, capacity and the auxiliary loss match one device), and dispatches only its
slice: the sequence shard with SP, else a contiguous 1/tp of the flattened tokens, all-gathered after
combine. The router weight's gradient is then a TP partial sum, and the auxiliary loss is stored as
aux/tp on each TP rank (its sum over all ranks is the true value).

Experts tensor-parallel inside (``plait.init(..., expert_tp=True)``; Megatron-LM's "expert tensor
parallelism", ``--expert-tensor-parallel-size``): EP groups are runs of ``ep`` consecutive DP ranks with
the same tp_rank (so ep | dp), and every TP rank of an EP rank holds the same experts, each split like
the dense MLP: gate/up by output columns, down by input rows (``tensor_parallel.layers``, so state dicts,
optimizer norms and checkpoints see ordinary TP shards). Every TP rank dispatches all the tokens over
its EP group; each expert returns TP partial sums, combined per token and then summed over TP once
(all-reduce, or reduce-scatter to the sequence shard with SP). Expert shards are reduced over the
expert-DP group (same tp_rank and ep_rank, dp/ep ranks).
"""

from __future__ import annotations

import torch
from torch import nn

from plait.context_parallel.routing import split_sequence_aux_loss
from plait.data_parallel.reducer import set_grad_group
from plait.distributed.context import ParallelContext
from plait.errors import ConfigError, FieldError, divisors
from plait.experts.comms import gather_rows
from plait.experts.dispatch import count_routing, dispatch_combine
from plait.models.moe import Expert, MoE, route
from plait.tensor_parallel import comms
from plait.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, mark_tp_partial


class ExpertParallelMoE(nn.Module):
    """The experts of one MoE layer spread over ``ctx``'s EP group; same state-dict keys as ``MoE``."""

    def __init__(self, moe: MoE, ctx: ParallelContext, sequence_parallel: bool = False):
        super().__init__()
        check_experts(moe.n_experts, ctx.ep_size)
        self.ctx, self.sequence_parallel = ctx, sequence_parallel and ctx.tp_size > 1
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.capacity_factor, self.aux_loss_coef = moe.capacity_factor, moe.aux_loss_coef
        self.gate = moe.gate
        if ctx.tp_size > 1:
            mark_tp_partial(self.gate.weight)  # each TP rank's gradient covers its own token slice
        per = moe.n_experts // ctx.ep_size
        self.first_expert = ctx.ep_rank * per
        own = range(self.first_expert, self.first_expert + per)
        self.experts = nn.ModuleDict({str(i): moe.experts[i] for i in own})  # keys = global expert ids
        if ctx.expert_tp:
            for expert in self.experts.values():
                _shard_expert(expert, ctx)
        for p in self.experts.parameters():
            set_grad_group(p, ctx.expert_dp_group, ctx.expert_dp_size)
        self.aux_loss: torch.Tensor | None = None
        self.layer_index = 0  # among the whole model's MoE layers (plait.experts.load.RoutingTally numbers them)
        self.routed: torch.Tensor | None = None  # [E + 1] the last forward's dispatched assignments, dropped last
        self.plain_keys = list(moe.state_dict().keys())  # every expert's, for full state dicts

    def _my_tokens(self, b: int, s: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """Flat indices (into [B·S]) of the tokens this TP rank dispatches, and every TP rank's count."""
        t, r = self.ctx.tp_size, self.ctx.tp_rank
        if self.sequence_parallel:  # our sequence shard, [B, S/t] order
            shard = s // t
            pos = torch.arange(b, device=device).unsqueeze(1) * s + torch.arange(r * shard, (r + 1) * shard,
                                                                                 device=device)
            return pos.reshape(-1), [b * shard] * t
        parts = torch.arange(b * s, device=device).tensor_split(t)
        return parts[r], [len(p) for p in parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, H], or [B, S/t, H] with SP
        ctx = self.ctx
        # enter the TP region: full sequences on every TP rank. Unlike the dense regions' projections
        # (tensor_parallel.regather), the router and the experts keep what they save of the gathered tokens.
        if ctx.tp_size > 1:
            x = comms.gather_seq(x, ctx.tp_group) if self.sequence_parallel else comms.copy_to_tp(x, ctx.tp_group)
        b, s, h = x.shape
        logits = self.gate(x)  # [B, S, E]
        r = route(logits, self.top_k, self.capacity_factor, self.aux_loss_coef)
        aux = r.aux if ctx.cp_size == 1 else split_sequence_aux_loss(logits, r.expert, self.aux_loss_coef,
                                                                      ctx.cp_group, ctx.cp_size)
        self.aux_loss = aux / ctx.tp_size
        flat = x.reshape(b * s, h)
        expert, gate, keep = (t.reshape(b * s, -1) for t in (r.expert, r.gate, r.keep))
        if ctx.expert_tp:  # every TP rank dispatches every token; experts return TP partial sums
            self.routed = count_routing(expert, keep, self.n_experts) * int(ctx.tp_rank == 0)  # counted once
            y = dispatch_combine(flat, expert, gate, keep, list(self.experts.values()), self.n_experts,
                                 ctx.ep_size, ctx.ep_group).view(b, s, h)
            return (comms.reduce_scatter_seq(y, ctx.tp_group) if self.sequence_parallel
                    else comms.reduce_from_tp(y, ctx.tp_group))
        if ctx.tp_size > 1:
            mine, sizes = self._my_tokens(b, s, x.device)
            flat, expert, gate, keep = flat[mine], expert[mine], gate[mine], keep[mine]
        self.routed = count_routing(expert, keep, self.n_experts)
        y = dispatch_combine(flat, expert, gate, keep, list(self.experts.values()), self.n_experts,
                             ctx.ep_size, ctx.ep_group)  # [n, H]
        if ctx.tp_size == 1:
            return y.view(b, s, h)
        if self.sequence_parallel:
            return y.view(b, s // ctx.tp_size, h)
        return gather_rows(y, sizes, ctx.tp_group).view(b, s, h)

    def extra_repr(self) -> str:
        per = len(self.experts)
        tp = f", split over tp={self.ctx.tp_size}" if self.ctx.expert_tp else ""
        return (f"experts {self.first_expert}..{self.first_expert + per - 1} of {self.n_experts} "
                f"(ep={self.ctx.ep_size}{tp}), top_k={self.top_k}, capacity_factor={self.capacity_factor}")


def _shard_expert(expert: nn.Module, ctx: ParallelContext) -> None:
    """Split one SwiGLU expert over TP in place: gate/up column-parallel, down row-parallel without reduce."""
    assert isinstance(expert, Expert), f"an MoE layer holds Expert modules, not {type(expert).__name__}"
    ffn = expert.gate_proj.out_features
    if ffn % ctx.tp_size:
        raise ConfigError(f"expert_tp=True needs tp={ctx.tp_size} to divide each expert's ffn_dim={ffn}; use "
                          "another tp or expert_tp=False")
    sharded = {"gate_proj": ColumnParallelLinear.from_dense(expert.gate_proj, ctx, input_comm=False),
               "up_proj": ColumnParallelLinear.from_dense(expert.up_proj, ctx, input_comm=False),
               "down_proj": RowParallelLinear.from_dense(expert.down_proj, ctx, reduce_output=False)}
    for name, layer in sharded.items():
        setattr(expert, name, layer)


def plain_state_keys(model: nn.Module) -> list[str]:
    """``model.state_dict()``'s keys as before expert sharding (every expert of every MoE layer, in order)."""
    ep_layers = {f"{path}.": m for path, m in model.named_modules() if isinstance(m, ExpertParallelMoE)}
    keys: list[str] = []
    done: set[str] = set()
    for key in model.state_dict():
        prefix = next((p for p in ep_layers if key.startswith(p)), None)
        if prefix is None:
            keys.append(key)
        elif prefix not in done:
            done.add(prefix)
            keys += [prefix + k for k in ep_layers[prefix].plain_keys]
    return keys


def check_experts(n_experts: int, ep: int) -> None:
    """FieldError on ``ep`` (before any collective) unless it divides the number of experts."""
    if n_experts % ep:
        raise FieldError("ep", ep, "must divide {n_experts}: each EP rank holds an equal share of the experts; "
                         f"valid: {divisors(n_experts)}", {"n_experts": n_experts})


def check_model_experts(model: nn.Module, ep: int) -> None:
    """Validate a model's MoE layers against ``ep`` (no collective): ep > 1 needs experts, ep | n_experts."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if ep > 1 and not layers:
        raise ConfigError(f"ep={ep} needs a mixture-of-experts model (n_experts > 1); use ep=1")
    for m in layers:
        check_experts(m.n_experts, ep)


def apply_expert_parallel(model: nn.Module, ctx: ParallelContext, sequence_parallel: bool = False) -> int:
    """Replace every ``MoE`` submodule of ``model`` by its expert-parallel version (in place); returns how many.

    Apply after the tensor-parallel plan (the layer enters the TP region itself).
    """
    check_model_experts(model, ctx.ep_size)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    for path, moe in layers:
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, ExpertParallelMoE(moe, ctx, sequence_parallel))
    return len(layers)
