"""Benchmark: bytes per rank of parameters, gradients and optimizer state under ZeRO 0/1/2 (dp2, dp4), measured
against the formula, and step times of ZeRO 0/1/2 as ratios measured in the same run.

One Gloo world of 4 CPU ranks runs a small Llama under tp2·dp2 and dp4 (pp1), fp32 and bf16. Per rank it
reads ``pm.memory_report()`` after a few steps and compares it with the per-parameter formula of
docs/optim.md without the bucket padding and AdamW's 4-byte step counters (so the ratios sit just above
1): params 4 B (2 B with bf16 parameters under ZeRO), grads 4 B (÷ d under ZeRO-2), optimizer 8 B (fp32:
the parameters are the masters) or 12 B (bf16: fp32 masters + moments), ÷ d under ZeRO-1/2. The planner's
``plait.plan.memory.state_bytes`` (2 + 4 + 12 B with ZeRO sharding) is printed beside the bf16 rows.
Times: median ``train_step`` + ``opt.step`` of the three ZeRO stages, stepped in turn (ABCABC...) so the
machine's load hits them alike; ratios against ZeRO-0. Also the cost of the saved-tensor meter
(``train_step(measure_memory=True)`` against False, alternated). Prints a table and JSON. Not a test.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

CFG = dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=64)
BATCH, STEPS, WARM = 8, 8, 2
LAYOUTS = [(2, 2), (1, 4)]  # (tp, dp) with pp=1 on 4 ranks


def _planner(cfg, tp: int, dp: int, zero: int) -> tuple[float, float, float]:
    from plait.plan.config import Layout
    from plait.plan.memory import state_bytes
    from plait.plan.model import Model

    m = Model(n_layers=cfg.n_layers, hidden=cfg.dim, n_heads=cfg.n_heads, vocab=cfg.vocab_size,
              seq_len=cfg.max_seq_len, ffn_hidden=cfg.ffn_dim, n_kv_heads=cfg.n_kv_heads, glu=True,
              tied_embeddings=cfg.tie_embeddings)
    return state_bytes(m, Layout(tp=tp, pp=1, dp=dp, zero=zero), cfg.n_layers, True, True)


def formula(n: int, dp: int, zero: int, precision: str) -> dict:
    """Per-rank bytes for ``n`` local parameters (docs/optim.md, without padding and step counters)."""
    bf16 = zero > 0 and precision == "bf16"
    return {"params": (2 if bf16 else 4) * n, "grads": 4 * n / (dp if zero == 2 else 1),
            "optimizer": (12 if bf16 else 8) * n / (dp if zero else 1)}


def _batch(ctx, cfg):
    import torch

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.max_seq_len + 1), generator=g)
    per = BATCH // ctx.dp_size
    rows = tokens[ctx.dp_rank * per:(ctx.dp_rank + 1) * per]
    return rows[:, :-1], rows[:, 1:]


def _zero_stages(ctx, cfg, precision: str) -> list[dict]:
    """ZeRO 0, 1 and 2 side by side, stepped in turn; memory after the last step."""
    import torch

    import plait
    from plait.models import Llama
    from plait.optim import build_optimizer

    runs = []
    for zero in (0, 1, 2):
        torch.manual_seed(0)
        pm = plait.parallelize(Llama(cfg), ctx, microbatches=1, precision=precision)
        opt = build_optimizer(pm, lr=1e-3, weight_decay=0.1, zero=zero, clip=1.0, warmup=2, total_steps=STEPS)
        runs.append((zero, pm, opt, []))
    x, y = _batch(ctx, cfg)
    for _ in range(STEPS):
        for _, pm, opt, times in runs:
            t0 = time.perf_counter()
            pm.train_step(x, y)
            opt.step()
            times.append(time.perf_counter() - t0)
    rows = []
    for zero, pm, _, times in runs:
        n = sum(p.numel() for p in pm.parameters())
        rows.append({"zero": zero, "local_params": n, "measured": pm.memory_report(),
                     "formula": formula(n, ctx.dp_size, zero, precision),
                     "step_ms": 1e3 * statistics.median(times[WARM:])})
    return rows


def _meter_cost(ctx, cfg) -> dict:
    """train_step with the saved-tensor meter against without, alternated."""
    import torch

    import plait
    from plait.models import Llama

    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg), ctx, microbatches=2)
    x, y = _batch(ctx, cfg)
    times = {True: [], False: []}
    for i in range(2 * STEPS):
        measure = i % 2 == 0
        t0 = time.perf_counter()
        pm.train_step(x, y, measure_memory=measure)
        times[measure].append(time.perf_counter() - t0)
    on, off = (statistics.median(times[k][1:]) for k in (True, False))
    return {"with_meter_ms": 1e3 * on, "without_ms": 1e3 * off, "ratio": on / off}


def rank_main() -> dict:
    import plait
    from plait.models import LlamaConfig

    cfg = LlamaConfig(**CFG)
    rows = []
    for tp, dp in LAYOUTS:
        ctx = plait.init(tp=tp, pp=1, dp=dp)
        for precision in ("fp32", "bf16"):
            for r in _zero_stages(ctx, cfg, precision):
                r.update(tp=tp, dp=dp, precision=precision, rank=ctx.rank, planner=_planner(cfg, tp, dp, r["zero"]))
                rows.append(r)
    return {"rows": rows, "meter": _meter_cost(plait.init(tp=2, pp=1, dp=2), cfg)}


def _table(rows: list[dict]) -> None:
    head = (f"{'layout':<9}{'prec':<6}{'zero':>4}{'params MB':>11}{'grads MB':>10}{'optim MB':>10}  "
            f"{'measured/formula':<18}{'planner optim':>14}{'step':>9}{'vs zero0':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        m, f = r["measured"], r["formula"]
        ratios = "/".join(f"{m[k] / f[k]:.3f}" for k in ("params", "grads", "optimizer"))
        plan = f"{r['planner'][2] / 2**20:.2f} MB" if r["precision"] == "bf16" else "-"
        print(f"tp{r['tp']}·dp{r['dp']:<4}{r['precision']:<6}{r['zero']:>4}{m['params'] / 2**20:>11.2f}"
              f"{m['grads'] / 2**20:>10.2f}{m['optimizer'] / 2**20:>10.2f}  {ratios:<18}{plan:>14}"
              f"{r['step_ms']:>6.0f} ms{r['vs_zero0']:>8.2f}x")


def main() -> None:
    import os

    from plait.distributed.launch import run_world

    load = os.getloadavg()[0]
    per_rank = run_world(rank_main, 4, timeout_s=1200)
    rows = []
    for i, r0 in enumerate(per_rank[0]["rows"]):
        ranks = [pr["rows"][i] for pr in per_rank]
        worst = max(ranks, key=lambda r: sum(r["measured"].values()) - r["measured"]["activations_peak"])
        row = {k: r0[k] for k in ("tp", "dp", "zero", "precision", "planner")}
        row.update(measured=worst["measured"], formula=worst["formula"], rank=worst["rank"],
                   step_ms=max(r["step_ms"] for r in ranks))  # the most loaded rank, the slowest rank
        rows.append(row)
    for r in rows:
        base = next(q for q in rows if (q["tp"], q["dp"], q["precision"], q["zero"]) ==
                    (r["tp"], r["dp"], r["precision"], 0))
        r["vs_zero0"] = r["step_ms"] / base["step_ms"]
    _table(rows)
    meter = per_rank[0]["meter"]
    print(f"\nsaved-tensor meter (tp2·dp2, fp32, 2 micro-batches): train_step {meter['with_meter_ms']:.0f} ms with, "
          f"{meter['without_ms']:.0f} ms without: {meter['ratio']:.3f}x")
    print(f"load average at start: {load:.1f} on {os.cpu_count()} cores")
    print(json.dumps({"config": CFG, "batch": BATCH, "rows": rows, "meter": per_rank[0]["meter"], "load": load},
                     indent=1))


if __name__ == "__main__":
    sys.exit(main())
