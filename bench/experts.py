"""Benchmark: expert-parallel token dispatch (all-to-all vs all-gather) and MoE training tokens/s (ep=2 vs 1).

One launch of 2 CPU ranks (Gloo):
  1. dispatch + combine, forward + backward, of the same routed tokens through (a) plait's all-to-all
     dispatcher (counts exchanged first, variable splits) and (b) an all-gather dispatcher (every rank
     gathers all tokens of the EP group, runs its own experts on the ones routed to them, and a
     reduce-scatter returns the sums), with identity experts (communication and permutation only) and
     with real SwiGLU experts; trials alternate.
  2. tokens/s of train_step of a small MoE Llama at dp=2 with ep=2 (each rank holds half the experts)
     vs ep=1 (every rank holds all of them), same global batch.
Prints a table and JSON (ratio = all-to-all / all-gather and ep2 / ep1).

    .venv/bin/python bench/experts.py [--tokens 512,2048] [--dim 256] [--trials 5] [--iters 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _allgather_dispatch(x, r, experts, first: int, group):
    """All-gather dispatcher: [n, H] local tokens -> [n, H] outputs; experts see every routed token."""
    from plait.tensor_parallel import comms

    xs = comms.gather_seq(x, group, dim=0)  # [ep·n, H], reduce-scatter in backward
    expert = comms.all_gather(r[0], 0, group)  # [ep·n, k] routing of every token (no gradient)
    gate = comms.gather_seq(r[1], group, dim=0)  # [ep·n, k]
    out = torch.zeros_like(xs)
    for j, module in enumerate(experts):
        token, slot = torch.nonzero(expert == first + j, as_tuple=True)
        out = out.index_add(0, token, module(xs[token]) * gate[token, slot].unsqueeze(-1))
    return comms.reduce_scatter_seq(out, group, dim=0)  # [n, H] summed over the EP group


def _time(fn, x, iters: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        inp = x.detach().requires_grad_(True)
        fn(inp).square().sum().backward()
    dist.barrier()
    return (time.perf_counter() - t0) / iters * 1e3  # ms


def _dispatch_rows(args) -> list[dict]:
    import torch.distributed as dist
    from torch import nn

    from plait.experts.dispatch import dispatch_combine
    from plait.models.moe import Expert

    group, ep, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    n_experts, k, rows = 8, 2, []
    per = n_experts // ep
    for n in args.tokens:
        for kind in ("identity", "swiglu"):
            torch.manual_seed(rank)
            x = torch.randn(n, args.dim)
            logits = torch.randn(n, n_experts)
            gate, expert = logits.softmax(-1).topk(k, dim=-1)
            keep = torch.ones_like(expert, dtype=torch.bool)
            torch.manual_seed(0)
            experts = [nn.Identity() if kind == "identity" else Expert(args.dim, 2 * args.dim) for _ in range(per)]
            first = rank * per

            def a2a(inp, e=expert, g=gate, kp=keep, ex=experts):
                return dispatch_combine(inp, e, g, kp, ex, n_experts, ep, group)

            def ag(inp, e=expert, g=gate, ex=experts, f=first):
                return _allgather_dispatch(inp, (e, g), ex, f, group)

            same = torch.allclose(a2a(x), ag(x), atol=1e-5)  # both dispatchers compute the same output
            times: dict[str, list[float]] = {"a2a": [], "ag": []}
            _time(a2a, x, 1), _time(ag, x, 1)  # warm-up
            for _ in range(args.trials):
                times["a2a"].append(_time(a2a, x, args.iters))
                times["ag"].append(_time(ag, x, args.iters))
            a, g_ = statistics.median(times["a2a"]), statistics.median(times["ag"])
            rows.append({"part": "dispatch", "tokens_per_rank": n, "dim": args.dim, "experts": kind,
                         "all_to_all_ms": round(a, 3), "all_gather_ms": round(g_, 3), "ratio": round(a / g_, 3),
                         "outputs_equal": bool(same)})
    return rows


def _train_rows(args) -> list[dict]:
    import plait
    from plait.models import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, dim=args.dim // 2, n_layers=2, n_heads=4, n_experts=8, top_k=2,
                      max_seq_len=64)
    batch, seq = 8, 64
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    out = {}
    pms = {}
    for ep in (1, 2):
        ctx = plait.init(tp=1, pp=1, dp=2, ep=ep)
        torch.manual_seed(0)
        pms[ep] = (plait.parallelize(Llama(cfg), ctx, microbatches=2), ctx)
    times: dict[int, list[float]] = {1: [], 2: []}
    for trial in range(args.trials + 1):
        for ep, (pm, ctx) in pms.items():
            local = tokens[ctx.dp_rank * batch // 2:(ctx.dp_rank + 1) * batch // 2]
            t0 = time.perf_counter()
            for _ in range(args.iters):
                pm.train_step(local[:, :-1], local[:, 1:])
            if trial:  # the first round warms up
                times[ep].append((time.perf_counter() - t0) / args.iters)
    for ep in (1, 2):
        out[ep] = batch * seq / statistics.median(times[ep])
    return [{"part": "train", "model": f"Llama dim={cfg.dim} layers=2 E=8 top-2", "tokens_per_step": batch * seq,
             "ep1_tokens_per_s": round(out[1]), "ep2_tokens_per_s": round(out[2]),
             "ratio": round(out[2] / out[1], 3)}]


def _rank_main(args) -> list[dict]:
    import plait

    plait.init(tp=1, pp=1, dp=2, ep=2)  # the default group; the dispatch part uses the whole world as EP group
    torch.manual_seed(0)
    rows = _dispatch_rows(args)
    return rows + _train_rows(args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="512,2048")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    from plait.distributed.launch import run_world

    rows = run_world(_rank_main, 2, args, timeout_s=900, threads=1)[0]
    print("dispatch + combine, forward + backward, E=8 top-2, ep=2 (2 Gloo ranks, 1 thread each)")
    print(f"{'tokens/rank':>11} {'dim':>5} {'experts':>9} {'all-to-all ms':>14} {'all-gather ms':>14} {'ratio':>7}")
    for r in rows:
        if r["part"] == "dispatch":
            print(f"{r['tokens_per_rank']:>11} {r['dim']:>5} {r['experts']:>9} {r['all_to_all_ms']:>14.2f} "
                  f"{r['all_gather_ms']:>14.2f} {r['ratio']:>7.2f}")
    for r in rows:
        if r["part"] == "train":
            print(f"\ntrain_step, {r['model']}, dp=2, {r['tokens_per_step']} tokens/step: "
                  f"ep=1 {r['ep1_tokens_per_s']} tok/s, ep=2 {r['ep2_tokens_per_s']} tok/s, ratio {r['ratio']:.2f}")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
