"""Benchmark: bytes per rank of parameters, gradients and optimizer state under ZeRO 0/1/2 (dp2, dp4), measured
against the formula, and step times of ZeRO 0/1/2 as ratios measured in the same run; ZeRO-3 beside FSDP2.

One Gloo world of 4 CPU ranks runs a small Llama under tp2·dp2 and dp4 (pp1), fp32 and bf16. Per rank it
reads ``pm.memory_report()`` after a few steps and compares it with the per-parameter formula of
docs/optim.md without the bucket padding and AdamW's 4-byte step counters (so the ratios sit just above
1): params 4 B (2 B with bf16 parameters under ZeRO), grads 4 B (÷ d under ZeRO-2), optimizer 8 B (fp32:
the parameters are the masters) or 12 B (bf16: fp32 masters + moments), ÷ d under ZeRO-1/2. The planner's
``plait.plan.memory.state_bytes`` (2 + 4 + 12 B with ZeRO sharding) is printed beside the bf16 rows.
Times: median ``train_step`` + ``opt.step`` of the three ZeRO stages, stepped in turn (ABCABC...) so the
machine's load hits them alike; ratios against ZeRO-0. Also the cost of the saved-tensor meter
(``train_step(measure_memory=True)`` against False, alternated). Prints a table and JSON. Not a test.

``python bench/optim.py --zero3``: plait ZeRO-1/2/3 beside torch FSDP2 (``fully_shard`` per decoder layer and
on the root) on the same Llama, dp2 and dp4, one and two micro-batches per step, fp32, Gloo, stepped in turn:
step time and peak bytes per rank as ratios to FSDP2 (``zero3_main``). Peak bytes: the most of ``PEAK_STEPS``
steps per peer (stepped in turn; the lowest beside it), each the bytes held between steps plus the most malloc'd
bytes above them after any op of the step.

Both print a progress line per phase (per step under ``--zero3``) as they go; ``--help`` says how long they
take and how to run a short ``--zero3`` (``--steps``, ``--peak-steps``).
"""

from __future__ import annotations

import argparse
import functools
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
            _say(ctx.rank, f"tp{tp}·dp{dp} {precision}: ZeRO 0, 1 and 2, {STEPS} steps each")
            for r in _zero_stages(ctx, cfg, precision):
                r.update(tp=tp, dp=dp, precision=precision, rank=ctx.rank, planner=_planner(cfg, tp, dp, r["zero"]))
                rows.append(r)
    ctx = plait.init(tp=2, pp=1, dp=2)
    _say(ctx.rank, "the saved-tensor meter's cost")
    return {"rows": rows, "meter": _meter_cost(ctx, cfg)}


def _most_held(ranks: list[dict]) -> dict:
    """The rank's row holding the most parameter, gradient and optimizer bytes (the report's other entries are
    peaks, or None where they do not apply, as ``params_gathered_peak`` outside ZeRO-3)."""
    return max(ranks, key=lambda r: sum(r["measured"][k] for k in ("params", "grads", "optimizer")))


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/optim.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="ZeRO 0/1/2 bytes per rank against the formula and step-time ratios (default), or plait "
                    "ZeRO-1/2/3 beside torch FSDP2 (--zero3). Prints a progress line per phase as it goes, then "
                    "a table and JSON.",
        epilog="Duration, measured on 2 cores shared with other jobs: the default run takes 4 min at load 23-55 "
               "(9 at load 40-75); --zero3 runs four worlds (dp2, dp4; 1 and 2 micro-batches) and takes 2-7 min "
               "a world, 18 min in all at load 20-110 (the step times scale with the load; the ratios hold).\n\n"
               "Examples:\n"
               "  python bench/optim.py                                  # ZeRO 0/1/2, one world of 4 ranks\n"
               "  python bench/optim.py --zero3                          # ZeRO-1/2/3 beside FSDP2\n"
               "  python bench/optim.py --zero3 --steps 3 --peak-steps 1 # a quick look: about a third of it")
    p.add_argument("--zero3", action="store_true", help="plait ZeRO-1/2/3 beside torch FSDP2 (fully_shard per block)")
    p.add_argument("--steps", type=int, default=ZERO3_STEPS,
                   help=f"--zero3: timed steps per peer, the first {ZERO3_WARM} not counted (default %(default)s)")
    p.add_argument("--peak-steps", type=int, default=PEAK_STEPS,
                   help="--zero3: steps per peer whose peak bytes are sampled after every op (default %(default)s)")
    return p


def main() -> None:
    import os

    from plait.distributed.launch import run_world

    args = parser().parse_args()
    if args.steps < 1 or args.peak_steps < 1:
        parser().error(f"--steps and --peak-steps must be at least 1, got {args.steps} and {args.peak_steps}")
    if args.zero3:
        return zero3_main(args.steps, args.peak_steps)
    load = os.getloadavg()[0]
    print(f"ZeRO 0/1/2: one world of 4 ranks, tp2·dp2 and dp4, fp32 and bf16; load {load:.1f}", flush=True)
    per_rank = run_world(rank_main, 4, timeout_s=1200)
    rows = []
    for i, r0 in enumerate(per_rank[0]["rows"]):
        ranks = [pr["rows"][i] for pr in per_rank]
        worst = _most_held(ranks)
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


# ----------------------------------------------------------------------------- ZeRO-3 beside torch FSDP2
ZERO3_STEPS, ZERO3_WARM, PEAK_STEPS = 10, 2, 3
ADAMW = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


@functools.cache
def _mallinfo2():
    """glibc's ``mallinfo2``, looked up once: it is called after every op of a measured step, and loading libc
    and building the result type each time cost ~40x the call itself."""
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    fn = ctypes.CDLL("libc.so.6").mallinfo2
    fn.restype = Mallinfo2
    return fn


def _in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back (heap + mmapped chunks): every CPU tensor."""
    info = _mallinfo2()()
    return int(info.uordblks + info.hblkhd)


def _step_peak(step) -> int:
    """Most bytes in use beyond those in use before ``step()``, sampled after every op it dispatches (the same
    yardstick for both peers: whatever they allocate — gathered weights, activations, gradients, temporaries)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Peak(TorchDispatchMode):
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Peak.peak = max(Peak.peak, _in_use())
            return out

    import gc

    gc.collect()
    base = _in_use()
    Peak.peak = base
    with Peak():
        step()
    return Peak.peak - base


def _fsdp2(cfg, dp: int, microbatches: int):
    """The peer: the same Llama (same seed) with torch's ``fully_shard`` on each decoder layer and on the root
    (embedding, final norm, head), AdamW over the DTensor shards, torch's clip_grad_norm_; ``microbatches``
    backward passes per step (each reduce-scatters, FSDP2's default), each of the mean loss over its rows / M."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from plait.memory import storage_bytes
    from plait.models import Llama
    from plait.optim import param_groups

    torch.manual_seed(0)
    model = Llama(cfg)
    mesh = init_device_mesh("cpu", (dp,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), ADAMW["weight_decay"]), lr=ADAMW["lr"],
                            betas=ADAMW["betas"], eps=ADAMW["eps"])  # plait's decay groups: no decay on norms

    def step(x, y) -> float:
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            (model.loss(xm, ym) / microbatches).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def held() -> int:
        local = [p.to_local() for p in model.parameters()]
        states = [t.to_local() if hasattr(t, "to_local") else t for st in opt.state.values() for t in st.values()
                  if torch.is_tensor(t)]
        return storage_bytes(local) + storage_bytes(states)

    return step, held


def _plait(ctx, cfg, zero: int, microbatches: int):
    import torch

    import plait
    from plait.models import Llama
    from plait.optim import build_optimizer

    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg), ctx, microbatches=microbatches, zero=zero)
    opt = build_optimizer(pm, lr=ADAMW["lr"], weight_decay=ADAMW["weight_decay"], zero=zero, clip=1.0,
                          betas=ADAMW["betas"], eps=ADAMW["eps"])

    def step(x, y) -> float:
        pm.train_step(x, y)
        return float(opt.step())

    def held() -> int:
        pm.zero_grad()
        m = pm.memory_report()
        return int(m["params"] + m["optimizer"])

    return step, held


def _say(rank: int, msg: str) -> None:
    """Progress on stdout from rank 0, flushed at once (a world prints nothing else until it ends)."""
    if rank == 0:
        print(f"  {time.strftime('%H:%M:%S')} {msg}", flush=True)


def zero3_rank(dp: int, microbatches: int, steps: int = ZERO3_STEPS, peak_steps: int = PEAK_STEPS) -> dict:
    """plait ZeRO-1/2/3 and FSDP2 on ``dp`` ranks, fp32, ``microbatches`` per step, stepped in turn (ABCD...)."""
    import plait
    from plait.models import LlamaConfig

    cfg = LlamaConfig(**CFG)
    ctx = plait.init(tp=1, pp=1, dp=dp)
    peers = {f"plait zero{z}": _plait(ctx, cfg, z, microbatches) for z in (1, 2, 3)}
    peers["torch FSDP2"] = _fsdp2(cfg, dp, microbatches)
    x, y = _batch(ctx, cfg)
    times: dict[str, list[float]] = {k: [] for k in peers}
    norms: dict[str, list[float]] = {k: [] for k in peers}
    for i in range(steps):
        for name, (step, _) in peers.items():
            t0 = time.perf_counter()
            norms[name].append(step(x, y))
            times[name].append(time.perf_counter() - t0)
        _say(ctx.rank, f"timed step {i + 1}/{steps}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
    peaks: dict[str, list[int]] = {k: [] for k in peers}
    for i in range(peak_steps):  # in turn too: a collective's buffers in flight differ a little from step to step
        t0 = time.perf_counter()
        for name, (step, held) in peers.items():
            peaks[name].append(held() + _step_peak(lambda step=step: step(x, y)))
        _say(ctx.rank, f"peak step {i + 1}/{peak_steps} of the four peers: {time.perf_counter() - t0:.1f} s")
    warm = min(ZERO3_WARM, steps - 1)
    return {name: {"step_ms": 1e3 * statistics.median(times[name][warm:]), "held": held(),
                   "peak": max(peaks[name]), "peak_min": min(peaks[name]), "norms": norms[name][:3]}
            for name, (_, held) in peers.items()}


ZERO3_WORLDS = ((2, 1), (4, 1), (2, 2), (4, 2))  # (dp, micro-batches per step)


def zero3_main(steps: int = ZERO3_STEPS, peak_steps: int = PEAK_STEPS) -> None:
    """``python bench/optim.py --zero3``: step time and peak bytes per rank, plait ZeRO-3 against FSDP2."""
    import os

    from plait.distributed.launch import run_world

    load = os.getloadavg()[0]
    print(f"plait ZeRO-1/2/3 beside torch FSDP2: {len(ZERO3_WORLDS)} worlds, each 4 peers x ({steps} timed + "
          f"{peak_steps} peak) steps; load {load:.1f} on {os.cpu_count()} cores", flush=True)
    rows = []
    for w, (dp, mb) in enumerate(ZERO3_WORLDS):
        print(f"world {w + 1}/{len(ZERO3_WORLDS)}: dp{dp}, {mb} micro-batch(es) per step", flush=True)
        t0 = time.perf_counter()
        per_rank = run_world(zero3_rank, dp, dp, mb, steps, peak_steps, timeout_s=1200)
        print(f"world {w + 1}/{len(ZERO3_WORLDS)} done in {time.perf_counter() - t0:.0f} s "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
        for name in per_rank[0]:
            ranks = [r[name] for r in per_rank]
            rows.append({"dp": dp, "mb": mb, "peer": name, "step_ms": max(r["step_ms"] for r in ranks),
                         "held": max(r["held"] for r in ranks), "peak": max(r["peak"] for r in ranks),
                         "peak_min": max(r["peak_min"] for r in ranks),
                         "norms": ranks[0]["norms"]})
    print(f"{'dp':>3}{'mb':>3}  {'peer':<13}{'step':>9}{'vs FSDP2':>10}{'held MB':>9}{'peak MB':>9}{'vs FSDP2':>10}"
          f"{'lowest':>8}  first gradient norms")
    for r in rows:
        peer = next(q for q in rows if (q["dp"], q["mb"]) == (r["dp"], r["mb"]) and q["peer"] == "torch FSDP2")
        r["time_vs_fsdp2"], r["peak_vs_fsdp2"] = r["step_ms"] / peer["step_ms"], r["peak"] / peer["peak"]
        print(f"{r['dp']:>3}{r['mb']:>3}  {r['peer']:<13}{r['step_ms']:>6.0f} ms{r['time_vs_fsdp2']:>9.2f}x"
              f"{r['held'] / 2**20:>9.2f}{r['peak'] / 2**20:>9.2f}{r['peak_vs_fsdp2']:>9.2f}x"
              f"{r['peak_min'] / 2**20:>8.2f}  "
              + " ".join(f"{n:.5f}" for n in r["norms"]))
    print(f"load average at start: {load:.1f}, at end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(json.dumps({"config": CFG, "batch": BATCH, "steps": steps, "peak_steps": peak_steps, "rows": rows,
                      "load": load}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
