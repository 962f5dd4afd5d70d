"""Benchmark: optimizer-state bytes per rank with and without ZeRO-1 (dp=2, dp=4) vs the planner, and step times.

One Gloo world of 4 CPU ranks runs a small Llama under tp2·dp2 and dp4, fp32 and bf16, zero 0 and 1. Per
rank it measures the bytes of the wrapped AdamW's state (the two fp32 moments) and compares them with
``plait.plan.memory.state_bytes``' optimizer term: 12 B/param (fp32 master + two moments, ZeRO sharding
all 12; Rajbhandari et al. 2020, §3.1). plait's master weights are the model's fp32 parameters, never
sharded (plait.optim.precision), so the measured sharded part is 8 B/param and the "moments" column
(8/12 of the prediction) is the like-for-like check. Times: median ``train_step`` and ``opt.step`` (the
latter includes ZeRO-1's reduce-scatter and all-gather). Prints a table and JSON. Not a test.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

CFG = dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=64)
BATCH, STEPS, WARM = 8, 6, 2
LAYOUTS = [(2, 2), (1, 4)]  # (tp, dp) with pp=1 on 4 ranks


def _predicted(cfg, tp: int, dp: int, zero: int) -> float:
    from plait.plan.config import Layout
    from plait.plan.memory import state_bytes
    from plait.plan.model import Model

    m = Model(n_layers=cfg.n_layers, hidden=cfg.dim, n_heads=cfg.n_heads, vocab=cfg.vocab_size,
              seq_len=cfg.max_seq_len, ffn_hidden=cfg.ffn_dim, n_kv_heads=cfg.n_kv_heads, glu=True,
              tied_embeddings=cfg.tie_embeddings)
    return state_bytes(m, Layout(tp=tp, pp=1, dp=dp, zero=zero), cfg.n_layers, True, True)[2]


def _one(ctx, cfg, zero: int, precision: str) -> dict:
    import torch

    import plait
    from plait.models import Llama
    from plait.optim import build_optimizer

    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg), ctx, microbatches=1, precision=precision)
    opt = build_optimizer(pm, lr=1e-3, weight_decay=0.1, zero=zero, clip=1.0, warmup=2, total_steps=STEPS)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.max_seq_len + 1), generator=g)
    per = BATCH // ctx.dp_size
    x = tokens[ctx.dp_rank * per:(ctx.dp_rank + 1) * per, :-1]
    y = tokens[ctx.dp_rank * per:(ctx.dp_rank + 1) * per, 1:]
    fwd_bwd, step = [], []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        pm.train_step(x, y)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        fwd_bwd.append(t1 - t0)
        step.append(t2 - t1)
    local = sum(p.numel() for p in pm.parameters())
    return {"state_bytes": opt.state_bytes(), "local_params": local,
            "master_bytes": sum(p.numel() * p.element_size() for p in pm.parameters()),
            "train_step_ms": 1e3 * statistics.median(fwd_bwd[WARM:]),
            "opt_step_ms": 1e3 * statistics.median(step[WARM:])}


def rank_main() -> list[dict]:
    import plait
    from plait.models import LlamaConfig

    cfg = LlamaConfig(**CFG)
    rows = []
    for tp, dp in LAYOUTS:
        ctx = plait.init(tp=tp, pp=1, dp=dp)
        for precision in ("fp32", "bf16"):
            for zero in (0, 1):
                r = _one(ctx, cfg, zero, precision)
                r.update(tp=tp, dp=dp, zero=zero, precision=precision, rank=ctx.rank,
                         predicted_optimizer_bytes=_predicted(cfg, tp, dp, zero))
                rows.append(r)
    return rows


def main() -> None:
    from plait.distributed.launch import run_world

    per_rank = run_world(rank_main, 4, timeout_s=900)
    rows = []
    for i, r0 in enumerate(per_rank[0]):
        ranks = [pr[i] for pr in per_rank]
        row = {k: r0[k] for k in ("tp", "dp", "zero", "precision", "local_params", "predicted_optimizer_bytes")}
        row["state_bytes_max"] = max(r["state_bytes"] for r in ranks)  # the most loaded rank
        row["master_bytes"] = r0["master_bytes"]
        row["train_step_ms"] = max(r["train_step_ms"] for r in ranks)
        row["opt_step_ms"] = max(r["opt_step_ms"] for r in ranks)
        row["moments_vs_prediction"] = row["state_bytes_max"] / (row["predicted_optimizer_bytes"] * 8 / 12)
        rows.append(row)
    head = (f"{'layout':<10}{'prec':<6}{'zero':>5}{'Adam state/rank':>17}{'planner 12B':>13}{'planner 8B':>12}"
            f"{'measured/8B':>12}{'fp32 master':>13}{'train_step':>12}{'opt.step':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        pred, name = r["predicted_optimizer_bytes"], f"tp{r['tp']}·dp{r['dp']}"
        print(f"{name:<10}{r['precision']:<6}{r['zero']:>5}"
              f"{r['state_bytes_max'] / 2**20:>14.2f} MB{pred / 2**20:>10.2f} MB{pred * 8 / 12 / 2**20:>9.2f} MB"
              f"{r['moments_vs_prediction']:>12.3f}{r['master_bytes'] / 2**20:>10.2f} MB"
              f"{r['train_step_ms']:>9.1f} ms{r['opt_step_ms']:>7.1f} ms")
    print(json.dumps({"config": CFG, "batch": BATCH, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
