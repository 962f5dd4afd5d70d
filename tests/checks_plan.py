"""The planner's search space is the runtime's: the values a search emits, and a covering set of layouts that
holds each of them, run through plait.parallelize for one optimizer step (inside the pipeline world of 4)."""

from __future__ import annotations

from dataclasses import fields

import torch

import plait
from harness import run_checks
from plait.models import Llama, LlamaConfig, init_weights
from plait.plan import Cluster, Layout, Model, Training
from plait.plan.config import check
from plait.plan.search import candidates

FIELDS = [f.name for f in fields(Layout)]
WORLD, BATCH, SEQ = 4, 8, 8


def small_moe() -> LlamaConfig:
    """Experts, so that the search also emits expert-parallel sizes."""
    return LlamaConfig(vocab_size=61, dim=32, n_layers=8, n_heads=4, n_kv_heads=2, max_seq_len=SEQ, n_experts=4,
                       top_k=2)


def emitted(cfg: LlamaConfig, world: int = WORLD, batch: int = BATCH, plan_only: bool = False) -> list[Layout]:
    """Every layout the search would estimate for ``cfg`` on ``world`` CPU processes (its valid candidates)."""
    model, training = Model.from_llama_config(cfg, SEQ), Training(batch)
    cluster = Cluster("cpu", world, gpus_per_node=world)
    return [lay for lay in candidates(model, cluster, training, plan_only)
            if check(model, cluster, lay, training) is None]


def values(layouts: list[Layout]) -> dict[str, set]:
    return {name: {getattr(lay, name) for lay in layouts} for name in FIELDS}


def covering(layouts: list[Layout]) -> list[Layout]:
    """A few layouts that between them hold every field value of ``layouts`` (greedy set cover; among equals
    the one with the fewest micro-batches per replica, the least work)."""
    need = {(name, getattr(lay, name)) for lay in layouts for name in FIELDS}
    chosen = []
    while need:
        best = max(layouts, key=lambda lay: (len({(n, getattr(lay, n)) for n in FIELDS} & need),
                                             lay.dp * lay.microbatch_size))
        chosen.append(best)
        need -= {(n, getattr(best, n)) for n in FIELDS}
    return chosen


def run_layout(layout: Layout) -> dict:
    """One optimizer step of the small MoE model under ``layout`` (fp32, ZeRO as planned) against one device."""
    from plait.checkpoint.shards import init_local
    from plait.optim import ParallelOptimizer

    cfg, training = small_moe(), Training(BATCH, precision="fp32")
    parallel = layout.to_parallel_config(training, precision="fp32")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        ref = float(init_weights(Llama(cfg), 5).loss(x, y))
    with torch.device("meta"):
        model = Llama(cfg)
    with plait.init(config=parallel) as ctx:
        pm = plait.parallelize(model, ctx, config=parallel)
        init_local(pm, 5)
        opt = ParallelOptimizer(pm, torch.optim.AdamW, lr=1e-3, zero=parallel.zero)
        per = BATCH // ctx.dp_size
        local = slice(ctx.dp_rank * per, (ctx.dp_rank + 1) * per)
        loss = pm.train_step(x[local], y[local])
        opt.step()
        after = pm.train_step(x[local], y[local])
    return {"layout": layout.short(), "loss_rel": abs(loss - ref) / ref, "moved": after != loss,
            "config": parallel.to_dict()}


def plan_checks() -> list:
    return [(f"plan/{i}", lambda lay=lay: run_layout(lay)) for i, lay in enumerate(covering(emitted(small_moe())))]


def rank_main() -> dict:
    return run_checks(plan_checks())
