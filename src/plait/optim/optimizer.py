"""ParallelOptimizer: a torch optimizer for a ParallelModel with exact global-norm clipping, an LR schedule,
weight-decay groups, bf16 mixed precision and a ZeRO-1 sharded optimizer state."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from plait.errors import ConfigError
from plait.optim.schedule import decays, lr_at
from plait.optim.shards import FlatLayout, Slot
from plait.parallel_config import ZERO_LEVELS

# torch >= 2.13 renames the flat collectives; older releases only have the *_tensor names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
STATE_FORMAT = "plait.optim/1"


class ParallelOptimizer:
    """Wraps ``optimizer_cls`` (AdamW by default) over a ParallelModel's local shards.

    ``zero=0``: every DP replica updates all of its local parameters (state on every replica).
    ``zero=1``: DP rank r keeps optimizer state for slice r of the flattened local parameters only
    (Rajbhandari et al. 2020, "ZeRO", P_os): gradients are reduce-scattered over DP (the model's own
    DP all-reduce is switched off; ``reduce_scatter=False`` keeps it and just reads the slice), each
    rank updates its slice in place, and an all-gather over DP brings every replica the new values.
    ``precision`` sets the model's precision ("fp32"/"bf16", see plait.optim.precision); None keeps it.
    ``clip``: max global gradient norm applied by ``step()`` (if ``clip_grad_norm_`` was not called).
    The learning rate of update k is ``lr_at(k, lr, warmup, total_steps, min_lr_ratio)``.
    """

    def __init__(self, pm, optimizer_cls=torch.optim.AdamW, *, lr: float = 1e-3, weight_decay: float = 0.0,
                 zero: int = 0, precision: str | None = None, clip: float | None = None, warmup: int = 0,
                 total_steps: int | None = None, min_lr_ratio: float = 0.1, reduce_scatter: bool = True,
                 **optim_kwargs):
        if zero not in ZERO_LEVELS:
            raise ConfigError(f"zero={zero!r}: plait.optim supports {', '.join(map(str, ZERO_LEVELS))} (0: replicated "
                              "state, 1: ZeRO-1)")
        if clip is not None and clip <= 0:
            raise ConfigError(f"clip={clip!r}: the max gradient norm must be positive (or None: no clipping)")
        if warmup < 0 or (total_steps is not None and total_steps < 1):
            raise ConfigError(f"warmup={warmup}, total_steps={total_steps}: need warmup >= 0, total_steps >= 1")
        if precision is not None:
            pm.set_precision(precision)
        self.pm, self.ctx, self.zero, self.clip = pm, pm.ctx, zero, clip
        self.base_lr, self.warmup, self.total_steps, self.min_lr_ratio = lr, warmup, total_steps, min_lr_ratio
        self.layout = FlatLayout(pm)
        self.reduce_scatter = zero == 1 and reduce_scatter and self.ctx.dp_size > 1
        self.pieces: list[tuple[Slot, nn.Parameter]] = self._make_pieces() if zero else []
        if self.reduce_scatter:
            pm.set_dp_grad_reduce(False)  # this optimizer sums gradients over DP (reduce-scatter) instead
        targets = self.pieces if zero else [(s, s.param) for s in self.layout.slots]
        targets = targets + [(s, s.param) for s in self.layout.own]  # experts: never sharded here
        groups = [{"params": [t for s, t in targets if decays(s.name, s.param) == d], "weight_decay": w}
                  for d, w in ((True, weight_decay), (False, 0.0))]
        groups = [g for g in groups if g["params"]]
        self.optimizer = optimizer_cls(groups, lr=lr, **optim_kwargs) if groups else None
        self.steps = 0
        self.last_norm: float | None = None
        self._prepared = self._clipped = False

    def _make_pieces(self) -> list[tuple[Slot, nn.Parameter]]:
        """Flat views of the owned slice of each parameter: updating them in place updates the model."""
        dtypes = {s.param.dtype for s in self.layout.slots}
        if len(dtypes) > 1:
            raise ConfigError(f"zero=1 needs one parameter dtype, found {sorted(map(str, dtypes))}")
        pieces = []
        for s in self.layout.owned():
            if not s.param.is_contiguous():
                raise ConfigError(f"zero=1 needs contiguous parameters; {s.name} is not")
            pieces.append((s, nn.Parameter(s.param.detach().view(-1)[s.lo:s.hi])))  # [hi-lo], shares storage
        return pieces

    # ------------------------------------------------------------------------------------- gradients
    def _prepare(self) -> None:
        """Once per step: under ZeRO-1, give every owned piece its DP-summed gradient."""
        if self._prepared:
            return
        self._prepared = True
        if not self.zero:
            return
        lay = self.layout
        if self.reduce_scatter:
            mine = torch.empty(lay.shard, dtype=torch.float32, device=self.ctx.device)  # [padded/dp]
            _reduce_scatter(mine, lay.flat_grads().to(self.ctx.device), group=self.ctx.dp_group)
            start = lay.dp_rank * lay.shard
            for s, piece in self.pieces:
                at = s.offset + s.lo - start
                piece.grad = mine[at:at + s.hi - s.lo].to(piece.dtype)
            self._reduce_own()
        else:
            for s, piece in self.pieces:
                g = s.param.grad
                piece.grad = piece.new_zeros(piece.shape) if g is None else g.reshape(-1)[s.lo:s.hi]

    def _reduce_own(self) -> None:
        """With the model's reducer off: sum gradients of own-group parameters (experts) over their group."""
        by_group: dict[int, list[Slot]] = {}
        for s in self.layout.own:
            if s.group_size > 1:
                by_group.setdefault(id(s.group), []).append(s)
        for slots in by_group.values():
            grads = [s.param.grad if s.param.grad is not None else torch.zeros_like(s.param) for s in slots]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=slots[0].group)
            offset = 0
            for s in slots:
                s.param.grad = flat[offset:offset + s.numel].view_as(s.param).clone()
                offset += s.numel

    def _owned_grads(self) -> list[tuple[Slot, torch.Tensor]]:
        """(slot, gradient of this DP rank's slice of it), reduced; own-group parameters whole."""
        own = [(s, s.param.grad.reshape(-1)) for s in self.layout.own if s.param.grad is not None]
        if self.zero:
            return [(s, piece.grad) for s, piece in self.pieces] + own
        sliced = [(s, s.param.grad.reshape(-1)[s.lo:s.hi]) for s in self.layout.owned()
                  if s.param.grad is not None]
        return sliced + own

    def _update_grads(self) -> list[torch.Tensor]:
        """The gradients the wrapped optimizer will read (what clipping scales)."""
        own = [s.param.grad for s in self.layout.own if s.param.grad is not None]
        if self.zero:
            return [piece.grad for _, piece in self.pieces] + own
        return [s.param.grad for s in self.layout.slots if s.param.grad is not None] + own

    def grad_norm(self) -> float:
        """Global L2 norm of the gradient of the whole model, every element counted once (see shards.py).

        One float64 all-reduce over the world; the same value on every rank.
        """
        self._prepare()
        sq = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for s, g in self._owned_grads():
            if s.counted:
                sq += g.detach().double().pow(2).sum()
        if self.ctx.world_size > 1:
            dist.all_reduce(sq, group=self.ctx.world_group)
        return math.sqrt(float(sq))

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale gradients so the global norm is at most ``max_norm``; returns the norm before clipping.

        Same rule as ``torch.nn.utils.clip_grad_norm_``: multiply by ``min(1, max_norm / (norm + 1e-6))``.
        """
        norm = self.grad_norm()
        coef = max_norm / (norm + 1e-6)
        grads = self._update_grads()
        if coef < 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        self.last_norm, self._clipped = norm, True
        return norm

    # ------------------------------------------------------------------------------------------ step
    @property
    def lr(self) -> float:
        """Learning rate of the next update."""
        return lr_at(self.steps, self.base_lr, self.warmup, self.total_steps, self.min_lr_ratio)

    @torch.no_grad()
    def step(self) -> float | None:
        """One update (clipping first if ``clip`` is set); returns the gradient norm if it was computed."""
        self._prepare()
        if self.clip is not None and not self._clipped:
            self.clip_grad_norm_(self.clip)
        if self.optimizer is not None:
            lr = self.lr
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        if self.zero and self.ctx.dp_size > 1 and self.layout.slots:
            self._all_gather()
        self.steps += 1
        norm = self.last_norm if self._clipped else None
        self._prepared = self._clipped = False
        return norm

    def _all_gather(self) -> None:
        """ZeRO-1: every DP rank sends its updated slice; every replica gets all of them."""
        lay = self.layout
        dtype = lay.slots[0].param.dtype
        parts = [piece.detach() for _, piece in self.pieces]
        used = sum(p.numel() for p in parts)
        parts.append(torch.zeros(lay.shard - used, dtype=dtype, device=self.ctx.device))
        full = torch.empty(lay.padded, dtype=dtype, device=self.ctx.device)  # [dp * shard]
        _all_gather(full, torch.cat(parts), group=self.ctx.dp_group)
        for s in lay.slots:
            s.param.view(-1).copy_(full[s.offset:s.offset + s.numel])

    def zero_grad(self) -> None:
        self.pm.zero_grad()
        for _, piece in self.pieces:
            piece.grad = None
        self._prepared = self._clipped = False

    # ----------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """This rank's optimizer state (save one file per rank; see docs/optim.md for the format)."""
        ctx = self.ctx
        return {
            "format": STATE_FORMAT, "zero": self.zero, "steps": self.steps, "precision": self.pm.precision,
            "coords": {"tp": (ctx.tp_rank, ctx.tp_size), "pp": (ctx.pp_rank, ctx.pp_size),
                       "dp": (ctx.dp_rank, ctx.dp_size)},
            "slots": self.layout.describe(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Load a state saved by the same rank of the same layout (no resharding)."""
        mine = self.state_dict()
        for key in ("format", "zero", "coords", "slots"):
            if _plain(state.get(key)) != _plain(mine[key]):
                raise ConfigError(f"optimizer state does not match this rank: {key}={state.get(key)!r} "
                                  f"saved, {mine[key]!r} here; load it with the same layout and zero")
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    @torch.no_grad()
    def gathered_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Optimizer state keyed by the model's local parameters, each tensor shaped like its parameter.

        What a layout-independent checkpointer saves (like ``torch.optim.Optimizer.state``). Under ZeRO-1
        the slices are all-gathered over DP (collective: call on every rank); scalars (``step``) are kept.
        """
        if self.optimizer is None and not self.zero:
            return {}
        if not self.zero:
            return dict(self.optimizer.state)
        out = {s.param: dict(self.optimizer.state.get(s.param, {})) for s in self.layout.own}
        names = sorted({k for _, pc in self.pieces for k, v in self.optimizer.state.get(pc, {}).items()
                        if torch.is_tensor(v) and v.dim() == 1})
        box = [names]
        dist.broadcast_object_list(box, src=self.ctx.global_rank(dp_rank=0), group=self.ctx.dp_group)
        for name in box[0]:  # e.g. exp_avg, exp_avg_sq: [padded] over DP, then cut per parameter
            full = self._gather_pieces(lambda pc, n=name: self.optimizer.state[pc][n])
            for s in self.layout.slots:
                out.setdefault(s.param, {})[name] = full[s.offset:s.offset + s.numel].view_as(s.param).clone()
        scalars = {k: v for pc in self.pieces[:1] for k, v in self.optimizer.state.get(pc[1], {}).items()
                   if not (torch.is_tensor(v) and v.dim() == 1)}
        for s in self.layout.slots:
            out[s.param].update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})
        return out

    @torch.no_grad()
    def load_gathered_state(self, state: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Inverse of ``gathered_state`` (no collective): each rank keeps its slices."""
        if self.optimizer is None:
            return
        if not self.zero:
            for p, st in state.items():
                self.optimizer.state[p] = dict(st)
            return
        for s in self.layout.own:
            if s.param in state:
                self.optimizer.state[s.param] = dict(state[s.param])
        for s, piece in self.pieces:
            st = state.get(s.param, {})
            self.optimizer.state[piece] = {
                k: (v.reshape(-1)[s.lo:s.hi].clone() if torch.is_tensor(v) and v.shape == s.param.shape else v)
                for k, v in st.items()}

    def _gather_pieces(self, value_of) -> torch.Tensor:
        """All-gather a per-piece tensor (same layout as the parameters' slices) into [dp * shard]."""
        lay = self.layout
        parts = [value_of(pc).reshape(-1) for _, pc in self.pieces]
        used = sum(p.numel() for p in parts)
        dtype = parts[0].dtype if parts else torch.float32
        parts.append(torch.zeros(lay.shard - used, dtype=dtype, device=self.ctx.device))
        full = torch.empty(lay.padded, dtype=dtype, device=self.ctx.device)
        _all_gather(full, torch.cat(parts), group=self.ctx.dp_group)
        return full

    def state_bytes(self) -> int:
        """Bytes of the wrapped optimizer's state tensors on this rank (Adam: the two moments)."""
        if self.optimizer is None:
            return 0
        return sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                   for t in st.values() if torch.is_tensor(t))


def _plain(value):
    """Tuples and lists compare equal after a save/load round trip."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def build_optimizer(pm, lr: float, weight_decay: float = 0.0, zero: int = 0, precision: str | None = None,
                    clip: float | None = None, warmup: int = 0, total_steps: int | None = None, *,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    min_lr_ratio: float = 0.1) -> ParallelOptimizer:
    """AdamW for the training loop: ``opt.step()`` after each ``pm.train_step`` clips (if ``clip``), sets the
    scheduled learning rate and updates; ``opt.last_norm`` is the gradient norm for logging."""
    return ParallelOptimizer(pm, torch.optim.AdamW, lr=lr, weight_decay=weight_decay, zero=zero,
                             precision=precision, clip=clip, warmup=warmup, total_steps=total_steps,
                             min_lr_ratio=min_lr_ratio, betas=betas, eps=eps)
