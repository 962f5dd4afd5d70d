"""Rank-side checks of ParallelContext.close() (4 ranks): repeated plait.init + close leaves no process-group
threads behind, a group the context was handed survives its close, and a closed context refuses use."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch
import torch.distributed as dist

import plait
from harness import run_checks
from plait.distributed.context import tp_group_context
from plait.models import Llama, LlamaConfig

TASKS = Path("/proc/self/task")  # one entry per thread of this process, the C++ ones included (Linux)
ROUNDS = 3
#: layouts that between them make every kind of group plait.init makes on CPU: the mesh's four dimensions,
#: the flattened dp·cp mesh, the expert meshes with and without expert_tp
LAYOUTS = [dict(tp=2, dp=2), dict(tp=2, pp=2), dict(cp=2, dp=2, ep=2), dict(tp=2, dp=2, ep=2, expert_tp=True)]


def threads() -> int:
    return len(os.listdir(TASKS))


def repeated_init() -> dict:
    """``ROUNDS`` rounds of every layout of LAYOUTS, each context used once and closed: this rank's thread count
    before, at its highest while a context was open, and after (no collection of garbage in between)."""
    gc.collect()
    before = peak = threads()
    for _ in range(ROUNDS):
        for layout in LAYOUTS:
            with plait.init(**layout) as ctx:
                x = torch.ones(1)
                dist.all_reduce(x, group=ctx.dp_cp_group)
                dist.all_reduce(x, group=ctx.expert_dp_group)
                peak = max(peak, threads())
    return {"before": before, "peak": peak, "after": threads(), "contexts": ROUNDS * len(LAYOUTS)}


def _steps(ctx, tied: bool, precision: str) -> dict:
    """A small Llama trained 3 steps under ``ctx``: this rank's threads while it lives (its groups: the
    context's and, with ``tied`` over pp > 1, the tie groups made for it) and the tensors alive after each
    step."""
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8, tie_embeddings=tied)
    pm = plait.parallelize(Llama(cfg), ctx, microbatches=1, precision=precision)
    x = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(ctx.dp_rank))
    tensors = []
    for _ in range(3):
        pm.train_step(x[:, :-1], x[:, 1:])
        gc.collect()
        tensors.append(sum(isinstance(o, torch.Tensor) for o in gc.get_objects()))
    return {"alive": threads(), "tensors": tensors, "tie_groups": len(pm.ties.pairs)}


MODELS = {"pp2dp2/tied": (dict(tp=1, pp=2, dp=2), True, "fp32"), "tp2dp2/bf16": (dict(tp=2, dp=2), False, "bf16")}


def models(name: str) -> dict:
    """A model's groups (its context's, the tie groups made for it, those its gradient buckets and bf16 copies
    use) go with its context and the model; a step leaves no tensor behind."""
    layout, tied, precision = MODELS[name]
    gc.collect()
    before = threads()
    with plait.init(**layout) as ctx:
        out = _steps(ctx, tied, precision)
    gc.collect()  # the model (and its reference cycles) is gone
    return {"before": before, "after": threads(), **out}


def borrowed_group() -> dict:
    """A context made around a group it was handed (tp_group_context) closes without destroying that group."""
    plait.init(dp=4).close()  # the default group, which stays
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, in the same order
    mine = pairs[rank // 2]
    ctx = tp_group_context(mine, torch.device("cpu"))
    ctx.close()
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=mine)
    out = {"ranks": dist.get_process_group_ranks(mine), "sum": float(x)}
    for g in pairs:
        if g is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)
    return out


def closed_use() -> dict:
    """A closed context raises ConfigError naming its state; closing twice is allowed; the default group stays."""
    ctx = plait.init(tp=2, dp=2)
    ctx.close()
    ctx.close()
    try:
        _ = ctx.tp_group
        message = None
    except plait.ConfigError as exc:
        message = str(exc)
    x = torch.ones(1)
    dist.all_reduce(x)  # the default group
    return {"message": message, "world_sum": float(x)}


def rank_main() -> dict:
    checks = [("borrowed", borrowed_group), ("closed_use", closed_use)]
    if TASKS.is_dir():
        checks += [("threads/repeated_init", repeated_init)]
        checks += [(f"threads/{name}", lambda n=name: models(n)) for name in MODELS]
    return run_checks(checks)
