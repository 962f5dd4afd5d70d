"""Benchmark: the serving policies in one process, measured in work (tokens fed), which machine load cannot blur.

The engine of ``plait serve`` (scheduler, paged KV, runner) on a random byte-level Llama on one device, no
HTTP: R requests, N of them in flight at any time (the first N arrive at once, then each one that ends is
replaced, as guidellm's concurrent profile does); every fourth has a long prompt, all ask max_tokens M,
sampled with fixed seeds and stop token ids, so most end early. A step's cost grows with the tokens it
feeds, so the work (tokens fed by all steps) from a request's arrival to its first token is its time to
first token in work units, and the work between two of its tokens its inter-token latency. Reported per
policy (as bench/serve.py): TTFT and ITL in work tokens (p50/p95), total work (recomputed tokens
included), steps, preemptions, the largest number of sequences running at once, CPU seconds, and
whether every policy gave the same tokens. ``--system-prompt N`` starts every prompt with the same N bytes
(a shared system prompt): the "prefix" policy (paged + chunked + prefix caching) then prefills them once.

    python bench/serve_policy.py --n 32 --requests 96 --max-tokens 64 --kv-budget 3072
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from plait.generation.decode import Sampling
from plait.models import Llama, LlamaConfig
from plait.serve.engine import Engine, Request
from plait.serve.kv import BlockAllocator
from plait.serve.metrics import Metrics
from plait.serve.runner import Runner
from plait.serve.sampling import Params
from plait.serve.scheduler import Scheduler

#: policy -> (reserve KV up front, step tokens (None: --step-tokens), prefix caching)
POLICIES = {"before": (True, 0, False), "paged": (False, 0, False), "chunked": (True, None, False),
            "after": (False, None, False), "prefix": (False, None, True)}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def run(model, policy: str, args: argparse.Namespace) -> dict:
    reserve, step, prefix = POLICIES[policy]
    blocks = -(-args.kv_budget // 16)
    sched = Scheduler(BlockAllocator(blocks, 16, prefix), args.n, args.step_tokens if step is None else step, reserve)
    engine = Engine(Runner(model, blocks, 16), sched, _NoText(), Metrics(), distributed=False)
    work, peak, marks = [0], [0], {}  # marks: request -> work at its arrival, then at each of its tokens
    schedule = sched.schedule

    def counted():  # wraps the scheduler: the work fed by every step, and the peak of running sequences
        pairs = schedule()
        work[0] += sum(n for _, n in pairs)
        peak[0] = max(peak[0], len(sched.running))
        return pairs

    sched.schedule = counted
    done, outs, sent = threading.Semaphore(0), {}, [0]

    def submit() -> None:  # the next request, if any is left
        i = sent[0]
        if i == args.requests:
            return
        sent[0] += 1
        marks[i] = [work[0]]
        size = args.long_prompt if i % 4 == 0 else 16 + i % 9
        system = ("You answer in one short line, without fuss. " * 20)[:args.system_prompt]
        text = system + f"request {i}: the quick brown fox jumps over the lazy dog " * 20
        prompt = list(text[:len(system) + size].encode())

        def sink(ev):
            if ev["type"] == "token":
                outs.setdefault(i, []).append(ev["id"])
                marks[i].append(work[0])
            elif ev["type"] in ("done", "error"):
                submit()
                done.release()
        engine.submit(Request(prompt, Params(Sampling(args.max_tokens, 0.8, 0, i)), sink,
                              stop_ids=frozenset({7, 11, 13, 17})))

    for _ in range(args.n):
        submit()
    t0 = time.process_time()
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    for _ in range(args.requests):
        done.acquire()
    cpu = time.process_time() - t0
    engine.stopping.set()
    thread.join(10)
    ttft = [m[1] - m[0] for m in marks.values() if len(m) > 1]
    gaps = [b - a for m in marks.values() for a, b in zip(m[1:], m[2:], strict=False)]
    return {"ttft_p50": _pct(ttft, 0.5), "ttft_p95": _pct(ttft, 0.95),
            "itl_p50": _pct(gaps, 0.5), "itl_p95": _pct(gaps, 0.95), "work": work[0], "steps": engine.metrics.steps,
            "preemptions": sched.preemptions, "peak_running": peak[0], "cpu_s": cpu, "cached": sched.cached_tokens,
            "ids": [outs.get(i, []) for i in range(args.requests)]}


class _NoText:
    """Token ids only: the work measured is the model's, not detokenisation."""

    def decode(self, ids: list[int]) -> str:
        return "x" * len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32, help="requests in flight")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, default=160)
    ap.add_argument("--kv-budget", type=int, default=3072)
    ap.add_argument("--step-tokens", type=int, default=256)
    ap.add_argument("--system-prompt", type=int, default=0, help="bytes of a system prompt every prompt starts with")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Llama(LlamaConfig(vocab_size=256, dim=128, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=256,
                              init_std=0.05)).eval()
    rows = {p: run(model, p, args) for p in POLICIES}
    same = len({json.dumps(r.pop("ids")) for r in rows.values()}) == 1
    print(f"serving policies in one process: {args.requests} requests, {args.n} in flight, max_tokens "
          f"{args.max_tokens}, every 4th "
          f"prompt {args.long_prompt} bytes, KV {args.kv_budget} positions, step tokens {args.step_tokens}; "
          f"work = tokens fed; same tokens under every policy: {same}")
    print(f"{'policy':<9}{'TTFT p50':>9}{'TTFT p95':>9}{'ITL p50':>8}{'ITL p95':>8}{'work':>7}{'steps':>6}"
          f"{'preempt':>8}{'peak':>5}{'CPU s':>7}{'cached':>7}")
    for name, r in rows.items():
        print(f"{name:<9}{r['ttft_p50']:>9.0f}{r['ttft_p95']:>9.0f}{r['itl_p50']:>8.0f}{r['itl_p95']:>8.0f}"
              f"{r['work']:>7}{r['steps']:>6}{r['preemptions']:>8}{r['peak_running']:>5}{r['cpu_s']:>7.2f}"
              f"{r['cached']:>7}")
    print(json.dumps({"args": vars(args), "same_tokens": same, "policies": rows}))


if __name__ == "__main__":
    main()
