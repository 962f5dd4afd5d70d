"""ParallelOptimizer: a torch optimizer for a ParallelModel with exact global-norm clipping, an LR schedule,
weight-decay groups, bf16 mixed precision and a sharded optimizer state (ZeRO-1, ZeRO-2 and, with the
parameters sharded too, ZeRO-3)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from plait.distributed.collectives import collective
from plait.errors import ConfigError, is_integer, is_number
from plait.memory import storage_bytes
from plait.optim.masters import Masters, gather_bucket
from plait.optim.schedule import decays, lr_at
from plait.optim.shards import ShardLayout
from plait.parallel_config import ZERO_LEVELS

if TYPE_CHECKING:
    from plait.parallel_model import ParallelModel

STATE_FORMAT = "plait.optim/2"
ZERO_MODES = {0: "all-reduce", 1: "reduce-scatter", 2: "reduce-scatter-free", 3: "reduce-scatter-free"}


class ParallelOptimizer:
    """Wraps ``optimizer_cls`` (AdamW by default) over a ParallelModel's local shards.

    ``zero=0``: gradients are all-reduced over DP (overlapped with the backward) and every replica updates
    all of its local parameters (optimizer state on every replica).
    ``zero=1`` (Megatron-LM's distributed optimizer; Rajbhandari et al. 2020, "ZeRO", P_os): the gradient
    buckets are reduce-scattered instead, DP rank r keeps the fp32 master weights and the optimizer state of
    its shard of every bucket only, updates them, and an all-gather per bucket brings every replica the new
    parameters. With ``precision="bf16"`` the model's parameters are then stored in bf16 (the masters live
    here): 2 B/param of weights, 4 B/param of fp32 gradients, 12 B/param ÷ d of masters and moments.
    ``zero=2`` (P_os+g): as ZeRO-1, and each rank keeps only its shard of the reduced gradient: the full
    gradient buffer of a bucket is freed once it is reduce-scattered (4 B/param ÷ d after the backward).
    ``zero=3`` (P_os+g+p, for a model built with ``plait.parallelize(..., zero=3)``): as ZeRO-2, and the
    parameters themselves are sharded (plait.data_parallel.param_shards): the float32 shard of each bucket is
    the master, gathered per block for its forward and backward (in bf16 with ``precision="bf16"``).
    ``reduce_scatter=False`` (zero=1 only) keeps the all-reduce and reads the owned shard (``.grad`` then
    stays the DP sum). ``precision`` sets the model's precision ("fp32"/"bf16"); None keeps it.
    ``clip``: max global gradient norm applied by ``step()`` (if ``clip_grad_norm_`` was not called).
    The learning rate of update k is ``lr_at(k, lr, warmup, total_steps, min_lr_ratio)``.
    """

    def __init__(self, pm, optimizer_cls=torch.optim.AdamW, *, lr: float = 1e-3, weight_decay: float = 0.0,
                 zero: int = 0, precision: str | None = None, clip: float | None = None, warmup: int = 0,
                 total_steps: int | None = None, min_lr_ratio: float = 0.1, reduce_scatter: bool = True,
                 **optim_kwargs):
        check_arguments(lr=lr, weight_decay=weight_decay, zero=zero, clip=clip, warmup=warmup,
                        total_steps=total_steps, min_lr_ratio=min_lr_ratio, reduce_scatter=reduce_scatter)
        if (zero == 3) != (pm.param_shards is not None):  # the arguments first, then the model they meet
            raise ConfigError(f"zero={zero} but the model was built with zero={pm.config.zero}: ZeRO-3 shards the "
                              "model's parameters, so build it with plait.parallelize(model, ctx, zero=3) and pass "
                              "zero=3 here (or neither)")
        if precision is not None:
            pm.set_precision(precision)
        self.pm, self.ctx, self.zero, self.clip = pm, pm.ctx, zero, clip
        self.base_lr, self.warmup, self.total_steps, self.min_lr_ratio = lr, warmup, total_steps, min_lr_ratio
        pm.set_grad_reduction(ZERO_MODES[zero] if reduce_scatter else "all-reduce")
        self.layout = ShardLayout(pm)
        self.masters = masters = Masters(self.layout, pm) if zero else None
        if masters is not None:
            targets = [(pc.name, pc.param, m) for pc, m in zip(self.layout.pieces, masters.params, strict=True)]
        else:
            targets = [(name, p, p) for name, p in pm.named_parameters() if p.requires_grad]
        groups = [{"params": [t for name, p, t in targets if decays(name, p) == d], "weight_decay": w}
                  for d, w in ((True, weight_decay), (False, 0.0))]
        groups = [g for g in groups if g["params"]]
        self.optimizer = optimizer_cls(groups, lr=lr, **optim_kwargs) if groups else None
        self.steps = 0
        self.last_norm: float | None = None
        self._prepared = self._clipped = False
        pm.attach_optimizer(self)

    # ------------------------------------------------------------------------------------- gradients
    def _prepare(self) -> None:
        """Once per step: under ZeRO, point every master piece at its reduced gradient (a view)."""
        if self._prepared:
            return
        newer = self.pm.attached_optimizer
        if newer is not self:  # every rank made the same optimizers in the same order: all refuse alike
            raise ConfigError(f"this ParallelOptimizer (zero={self.zero}) is no longer the model's: one made for the "
                              f"same model since (zero={getattr(newer, 'zero', None)}) set how train_step reduces the "
                              "gradients and which optimizer load_full_state_dict updates; step that one, or make "
                              "this one again")
        self._prepared = True
        if self.masters is not None:
            for pc, m in zip(self.layout.pieces, self.masters.params, strict=True):
                m.grad = pc.grad()

    def _update_grads(self) -> list[torch.Tensor]:
        """The gradients the wrapped optimizer will read (what clipping scales)."""
        if self.masters is not None:
            return [m.grad for m in self.masters.params if m.grad is not None]
        return [p.grad for p in self.pm.parameters() if p.grad is not None]

    def grad_norm(self) -> float:
        """Global L2 norm of the gradient of the whole model, every element counted once (see shards.py).

        One float64 all-reduce over the world; the same value on every rank.
        """
        self._prepare()
        sq = square_sum([pc.grad() for pc in self.layout.pieces if pc.counted]).to(self.ctx.device)
        if self.ctx.world_size > 1:
            group = self.ctx.world_group
            collective("all-reduce of the gradient norm", group, lambda: dist.all_reduce(sq, group=group))
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
        if self.masters is not None:
            self.masters.publish()
        self.steps += 1
        norm = self.last_norm if self._clipped else None
        self._prepared = self._clipped = False
        return norm

    def zero_grad(self) -> None:
        self.pm.zero_grad()
        for m in self.masters.params if self.masters is not None else []:
            m.grad = None
        self._prepared = self._clipped = False

    # ---------------------------------------------------------------------------------------- memory
    def state_bytes(self) -> int:
        """Bytes of the wrapped optimizer's state tensors on this rank (AdamW: the two moments and steps)."""
        if self.optimizer is None:
            return 0
        return storage_bytes(t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t))

    def memory_bytes(self) -> int:
        """Optimizer state plus the fp32 masters it holds apart from the model (``ParallelModel.memory_report``)."""
        return self.state_bytes() + (self.masters.nbytes() if self.masters is not None else 0)

    # ----------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """This rank's optimizer state (save one file per rank; see docs/optim.md for the format)."""
        ctx = self.ctx
        return {
            "format": STATE_FORMAT, "zero": self.zero, "steps": self.steps, "precision": self.pm.precision,
            "coords": {"tp": (ctx.tp_rank, ctx.tp_size), "pp": (ctx.pp_rank, ctx.pp_size),
                       "dp": (ctx.dp_rank, ctx.dp_size)},
            "layout": self.layout.describe(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "masters": self.masters.state() if self.masters is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        """Load a state saved by the same rank of the same layout (no resharding; collective under ZeRO
        with bf16 masters: the parameters are refreshed from them)."""
        mine = self.state_dict()
        for key in ("format", "zero", "coords", "layout", "precision"):
            if _plain(state.get(key)) != _plain(mine[key]):
                raise ConfigError(f"optimizer state does not match this rank: {key}={state.get(key)!r} "
                                  f"saved, {mine[key]!r} here; load it with the same layout, zero and precision")
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.masters is not None:
            self.masters.load_state(state["masters"])
        self.steps = int(state["steps"])

    @torch.no_grad()
    def gathered_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Optimizer state keyed by the model's local parameters, each tensor shaped like its parameter.

        What a layout-independent checkpointer saves (like ``torch.optim.Optimizer.state``). Under ZeRO the
        shards are all-gathered over each bucket's group (collective: call on every rank); scalars
        (``step``) are kept.
        """
        masters = self.masters
        if masters is None:
            return dict(self.optimizer.state) if self.optimizer is not None else {}
        state = self.optimizer.state if self.optimizer is not None else {}
        local = {k for m in masters.params for k, v in state.get(m, {}).items() if torch.is_tensor(v)
                 and v.dim() == 1}
        everyone: list = [None] * self.ctx.world_size
        collective("all-gather of the optimizer's shard owners", None,  # a rank may own no piece
                   lambda: dist.all_gather_object(everyone, sorted(local)))
        names = sorted(set().union(*map(set, everyone)))
        scalars = next(({k: v for k, v in state[m].items() if not (torch.is_tensor(v) and v.dim() == 1)}
                        for m in masters.params if m in state), {"step": torch.tensor(float(self.steps))})
        out: dict[nn.Parameter, dict] = {}
        for name in names:  # e.g. exp_avg, exp_avg_sq: [padded] per bucket, then cut per parameter
            it = iter(masters.params)
            for (_, b), pieces in zip(self.layout.buckets, self.layout.by_bucket, strict=True):
                local_shard = torch.zeros(b.shard, dtype=torch.float32, device=self.ctx.device)
                for pc in pieces:
                    m = next(it)
                    if m in state:
                        local_shard[pc.at:pc.at + pc.numel].copy_(state[m][name])
                full = gather_bucket(b, local_shard)
                for p, off in zip(b.params, b.offsets, strict=True):
                    out.setdefault(p, {})[name] = full[off:off + p.numel()].view(p.shape).clone()
        for st in out.values():
            st.update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})
        return out

    @torch.no_grad()
    def load_gathered_state(self, state: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Inverse of ``gathered_state`` (no collective): each rank keeps its shards."""
        if self.optimizer is None:
            return
        if self.masters is None:
            for p, st in state.items():
                self.optimizer.state[p] = dict(st)
            return
        for pc, m in zip(self.layout.pieces, self.masters.params, strict=True):
            st = state.get(pc.param, {})
            self.optimizer.state[m] = {
                k: (v.reshape(-1)[pc.lo:pc.hi].clone() if torch.is_tensor(v) and v.shape == pc.param.shape else v)
                for k, v in st.items()}

    @property
    def keeps_masters(self) -> bool:
        """True when fp32 master weights live here, apart from the model's (bf16) parameters."""
        return self.masters is not None and self.masters.separate

    def gathered_masters(self) -> dict[nn.Parameter, torch.Tensor]:
        """fp32 value of every local parameter when the masters live apart from the bf16 parameters (collective;
        what a checkpoint saves as the model's weights); empty otherwise."""
        return self.masters.gathered() if self.masters is not None else {}

    def load_master_weights(self, values: dict[nn.Parameter, torch.Tensor]) -> None:
        """Set the fp32 masters from full-precision local parameter values (after loading the model's bf16
        parameters from the same values; no collective). Nothing to do when the parameters are the masters."""
        if self.masters is not None:
            self.masters.load(values)


FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # device types with torch's fused AdamW kernel
NORM_CHUNK = 1 << 22  # elements cast to float64 at a time by the gradient norm (32 MB of temporary)
#: device types whose ``torch._foreach_norm`` is one fused multi-tensor kernel that reads each element once and
#: accumulates in the requested dtype (aten/src/ATen/native/cuda/ForeachReduceOp.cu: ``LpNormFunctor`` sums in the
#: opmath type of the output dtype); elsewhere it casts every whole tensor to that dtype first (a float64 copy)
FUSED_NORM_DEVICES = ("cuda",)


def square_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of every element of ``grads``, accumulated in float64: a scalar on their device.

    On a device with a fused norm (``FUSED_NORM_DEVICES``) one kernel per dtype reads every gradient once
    (float64 norms per tensor, squared and summed); elsewhere ``chunk_square_sums`` bounds the float64
    temporary to one chunk."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    if grads[0].device.type in FUSED_NORM_DEVICES:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        norms = [n for same in by_dtype.values() for n in torch._foreach_norm(same, 2, dtype=torch.float64)]
        return torch.stack(norms).square().sum()
    return torch.stack([d for g in grads for d in chunk_square_sums(g)]).sum()


def chunk_square_sums(grad: torch.Tensor) -> list[torch.Tensor]:
    """Sums of squares of ``grad`` in float64, one scalar per chunk of ``NORM_CHUNK`` elements, each chunk cast
    on its own: a float64 copy of a whole gradient (the embedding's: 8 B x vocab x hidden) would cost the rank a
    gigabyte of temporary at a billion parameters. Two kernels a chunk (the cast, the dot); the caller adds the
    scalars of all its gradients in one sum, so a model's norm costs no per-tensor accumulation kernels."""
    return [torch.dot(c, c) for c in (chunk.double() for chunk in grad.reshape(-1).split(NORM_CHUNK))]


def check_arguments(*, lr: object, weight_decay: object, zero: object, clip: object, warmup: object,
                    total_steps: object, min_lr_ratio: object, reduce_scatter: bool) -> None:
    """Raise ConfigError naming the first of ParallelOptimizer's arguments that is out of range, and the values
    it takes. Local and alike on every rank: a ParallelOptimizer refuses before it touches the model or runs
    a collective."""
    if not is_integer(zero) or zero not in ZERO_LEVELS:
        raise ConfigError(f"zero={zero!r}: plait.optim supports {', '.join(map(str, ZERO_LEVELS))} (0: replicated "
                          "state, 1: ZeRO-1, sharded masters and optimizer state, 2: ZeRO-2, gradients too, 3: "
                          "ZeRO-3, parameters too)")
    if zero >= 2 and not reduce_scatter:
        raise ConfigError(f"zero={zero} keeps only a shard of each gradient: it needs reduce_scatter=True")
    if not is_number(lr) or lr < 0:
        raise ConfigError(f"lr={lr!r}: the learning rate must be a finite number >= 0 (e.g. lr=3e-4)")
    if not is_number(weight_decay) or weight_decay < 0:
        raise ConfigError(f"weight_decay={weight_decay!r}: must be a finite number >= 0 (0: no decay, e.g. 0.1)")
    if clip is not None and (not is_number(clip) or clip <= 0):
        raise ConfigError(f"clip={clip!r}: the max gradient norm must be a finite number > 0 (e.g. clip=1.0), or "
                          "None: no clipping")
    if not is_integer(warmup) or warmup < 0:
        raise ConfigError(f"warmup={warmup!r}: the number of warm-up updates must be an int >= 0 (0: none)")
    if total_steps is not None and (not is_integer(total_steps) or total_steps < 1):
        raise ConfigError(f"total_steps={total_steps!r}: the update the cosine decay ends at must be an int >= 1, or "
                          "None: no decay after the warm-up")
    if not is_number(min_lr_ratio) or not 0 <= min_lr_ratio <= 1:
        raise ConfigError(f"min_lr_ratio={min_lr_ratio!r}: the fraction of lr the decay ends at must be a number "
                          "in [0, 1]")


def _plain(value):
    """Tuples and lists compare equal after a save/load round trip."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def build_optimizer(pm: ParallelModel, lr: float, weight_decay: float = 0.0, zero: int = 0,
                    precision: str | None = None, clip: float | None = None, warmup: int = 0,
                    total_steps: int | None = None, *, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    min_lr_ratio: float = 0.1) -> ParallelOptimizer:
    """AdamW for the training loop: ``opt.step()`` after each ``pm.train_step`` clips (if ``clip``), sets the
    scheduled learning rate and updates; ``opt.last_norm`` is the gradient norm for logging.

    torch's fused AdamW kernel where the device has one (CPU, CUDA): one pass over p, g, m and v per tensor,
    no temporaries. The per-tensor loop's temporary denominator costs 2 x the largest tensor (half a gigabyte
    for a 1B model's embedding) and runs 3-4x slower on CPU; the two agree to an ulp."""
    fused = {"fused": True} if pm.ctx.device.type in FUSED_ADAMW_DEVICES else {}
    return ParallelOptimizer(pm, torch.optim.AdamW, lr=lr, weight_decay=weight_decay, zero=zero,
                             precision=precision, clip=clip, warmup=warmup, total_steps=total_steps,
                             min_lr_ratio=min_lr_ratio, betas=betas, eps=eps, **fused)
