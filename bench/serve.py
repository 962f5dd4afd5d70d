"""Benchmark: plait serve throughput and latency, N concurrent requests (continuous batching) vs one at a time.

Starts ``plait serve`` on 127.0.0.1 (a random byte-level Llama saved to a temporary Hugging Face folder),
sends the same N greedy completion requests twice in the same run: one after another, then all at once
from N threads. Reports generated tokens/s, p50/p99 request latency and mean time to first token (from
streaming), checks both runs gave the same tokens, and prints a table and JSON. Not a test.

    python bench/serve.py --tp 1 --pp 2 --n 32 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def _model(path: Path, dim: int, layers: int) -> None:
    import torch

    from plait.models import Llama, LlamaConfig

    torch.manual_seed(0)
    Llama(LlamaConfig(vocab_size=256, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, max_seq_len=256,
                      init_std=0.05)).save_pretrained(path)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one(url: str, prompt: str, n: int) -> tuple[list[int], float, float]:
    """(token ids, latency, time to first token) of one streamed request."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": n, "stream": True}
    t0 = time.perf_counter()
    first, ids = None, []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as res:
        res.raise_for_status()
        for line in res.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            got = json.loads(line[6:])["choices"][0]["token_ids"]
            if got and first is None:
                first = time.perf_counter() - t0
            ids += got
    return ids, time.perf_counter() - t0, first or 0.0


def _run(url: str, prompts: list[str], n: int, concurrent: bool) -> dict:
    t0 = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: _one(url, p, n), prompts))
    else:
        results = [_one(url, p, n) for p in prompts]
    wall = time.perf_counter() - t0
    lat = sorted(r[1] for r in results)
    tokens = sum(len(r[0]) for r in results)
    return {"mode": "continuous batching" if concurrent else "one at a time", "requests": len(prompts),
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "p50_latency_s": statistics.median(lat), "p99_latency_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            "mean_ttft_s": statistics.mean(r[2] for r in results), "ids": [r[0] for r in results]}


def _wait(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"plait serve exited:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    sys.exit("plait serve did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--n", type=int, default=32, help="requests")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="plait-bench-serve-") as tmp:
        model = Path(tmp, "bench")
        _model(model, args.dim, args.layers)
        port, log = _port(), Path(tmp, "serve.log")
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "plait.cli.main", "serve", "--model", str(model), "--tp", str(args.tp),
               "--pp", str(args.pp), "--port", str(port), "--max-batch", str(args.n)]
        proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait(url, proc, log)
            prompts = [f"request {i}: the quick brown fox " + "z" * (i % 11) for i in range(args.n)]
            _run(url, prompts[:2], args.max_tokens, concurrent=False)  # warm-up
            seq = _run(url, prompts, args.max_tokens, concurrent=False)
            par = _run(url, prompts, args.max_tokens, concurrent=True)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    same = seq.pop("ids") == par.pop("ids")
    print(f"plait serve, tp {args.tp} x pp {args.pp}, {args.n} requests x {args.max_tokens} tokens, "
          f"dim {args.dim}, {args.layers} layers, {os.cpu_count()} cores; same tokens both ways: {same}")
    print(f"{'mode':<22}{'tokens/s':>10}{'wall s':>9}{'p50 s':>8}{'p99 s':>8}{'TTFT s':>8}")
    for r in (seq, par):
        print(f"{r['mode']:<22}{r['tokens_per_s']:>10.1f}{r['wall_s']:>9.2f}{r['p50_latency_s']:>8.2f}"
              f"{r['p99_latency_s']:>8.2f}{r['mean_ttft_s']:>8.2f}")
    print(json.dumps({"tp": args.tp, "pp": args.pp, "same_tokens": same, "runs": [seq, par]}))


if __name__ == "__main__":
    main()
