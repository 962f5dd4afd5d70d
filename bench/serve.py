"""Benchmark: plait serve at 32 concurrent requests, paged KV + chunked prefill against the policies before them.

Starts one server per policy on 127.0.0.1 (the same random byte-level Llama, saved to a temporary Hugging
Face folder), all at once, and alternates the trials between them:

    before   --kv-reserve --step-tokens 0   KV reserved for prompt + max_tokens at admission, whole prompts per step
    paged    --step-tokens 0                paged KV (blocks on demand, preemption), whole prompts per step
    chunked  --kv-reserve                   reserved KV, chunked prefill (--step-tokens per step)
    after    (defaults)                     paged KV and chunked prefill

The load: N streamed completions sent at once, a quarter with long prompts, max_tokens M, sampled with
fixed seeds and a few stop token ids (so most end early, as real requests do). Reported per policy:
generated tokens/s, time to first token p50/p95, inter-token latency mean/p95 (gaps between a request's
tokens), and whether every policy gave the same tokens. With ``--guidellm`` (the ``bench`` extra), guidellm's
concurrent profile with synthetic prompts runs against each server too. Prints a table and JSON. Not a test.

    python bench/serve.py --n 32 --max-tokens 64 --trials 2 --guidellm
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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

POLICIES = {"before": ["--kv-reserve", "--step-tokens", "0"], "paged": ["--step-tokens", "0"],
            "chunked": ["--kv-reserve"], "after": []}


def _model(path: Path, dim: int, layers: int, context: int) -> None:
    import torch

    from plait.models import Llama, LlamaConfig

    torch.manual_seed(0)
    Llama(LlamaConfig(vocab_size=256, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, max_seq_len=context,
                      init_std=0.05)).save_pretrained(path)


def _byte_tokenizer(path: Path, context: int) -> None:
    """tokenizer.json mapping byte b to id b (plait's byte-level ids), loadable by transformers (for guidellm)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's printable byte characters
    extra = iter(range(256, 512))
    chars = {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, log: Path, args: argparse.Namespace, flags: list[str]):
        self.port, self.log = _port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "plait.cli.main", "serve", "--model", str(model), "--name", "bench",
               "--tp", str(args.tp), "--pp", str(args.pp), "--port", str(self.port), "--max-batch", str(args.n),
               "--kv-budget", str(args.kv_budget), "--step-tokens", str(args.step_tokens), *flags]
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait(self) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"plait serve exited:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        sys.exit("plait serve did not become healthy")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _one(url: str, job: dict) -> tuple[list[int], float, list[float]]:
    """(token ids, time to first token, arrival time of each token) of one streamed request."""
    t0 = time.perf_counter()
    ids, times = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=job, timeout=600) as res:
        res.raise_for_status()
        for line in res.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            got = json.loads(line[6:])["choices"][0]["token_ids"]
            ids += got
            times += [time.perf_counter() - t0] * len(got)
    return ids, times[0] if times else 0.0, times


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def _load(url: str, jobs: list[dict]) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: _one(url, j), jobs))
    wall = time.perf_counter() - t0
    ttft = [r[1] for r in results]
    gaps = [b - a for r in results for a, b in zip(r[2], r[2][1:], strict=False)]
    tokens = sum(len(r[0]) for r in results)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "ttft_p50_s": _pct(ttft, 0.5),
            "ttft_p95_s": _pct(ttft, 0.95), "itl_mean_s": statistics.mean(gaps) if gaps else 0.0,
            "itl_p95_s": _pct(gaps, 0.95), "ids": [r[0] for r in results]}


def _jobs(n: int, max_tokens: int, long_prompt: int) -> list[dict]:
    out = []
    for i in range(n):
        size = long_prompt if i % 4 == 0 else 16 + i % 9
        prompt = (f"request {i}: the quick brown fox jumps over the lazy dog " * 20)[:size]
        out.append({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "seed": i,
                    "stop_token_ids": [7, 11, 13, 17], "stream": True})
    return out


def _guidellm(url: str, model: Path, out: Path, args: argparse.Namespace) -> dict:
    """guidellm's concurrent profile (synthetic prompts, ignore_eos) against one server; its metrics."""
    cmd = [str(_guidellm_command()), "run", "--backend", f"kind=openai_http,target={url},model=bench",
           "--tokenizer", f"kind=hf_auto,model={model}", "--profile", f"kind=concurrent,streams={args.n}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.guidellm_prompt},output_tokens={args.max_tokens}",
           "--constraint", f"kind=max_requests,count={2 * args.n}", "--output", f"kind=json,path={out}",
           "--disable-console"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    bench = json.loads(out.read_text())["benchmarks"][0]
    m = bench["metrics"]
    ok = m["request_totals"]["successful"]
    return {"requests_ok": ok, "requests_failed": m["request_totals"].get("errored", 0),
            "tokens_per_s": m["output_token_count"]["successful"]["total_sum"] / bench["duration"],
            "ttft_p50_s": m["time_to_first_token_ms"]["successful"]["median"] / 1e3,
            "ttft_p95_s": m["time_to_first_token_ms"]["successful"]["percentiles"]["p95"] / 1e3,
            "itl_mean_s": m["inter_token_latency_ms"]["successful"]["mean"] / 1e3,
            "itl_p95_s": m["inter_token_latency_ms"]["successful"]["percentiles"]["p95"] / 1e3}


def _median(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def _table(title: str, rows: dict[str, dict]) -> None:
    base = rows.get("before")
    print(f"\n{title}")
    print(f"{'policy':<9}{'tokens/s':>10}{'TTFT p50':>10}{'TTFT p95':>10}{'ITL mean':>10}{'ITL p95':>10}"
          f"{'  vs before: tok/s, TTFT p95, ITL p95':<40}")
    for name, r in rows.items():
        ratio = (f"  x{r['tokens_per_s'] / base['tokens_per_s']:.2f}, x{r['ttft_p95_s'] / base['ttft_p95_s']:.2f}, "
                 f"x{r['itl_p95_s'] / base['itl_p95_s']:.2f}") if base and base["ttft_p95_s"] > 0 else ""
        print(f"{name:<9}{r['tokens_per_s']:>10.1f}{r['ttft_p50_s']:>10.3f}{r['ttft_p95_s']:>10.3f}"
              f"{r['itl_mean_s']:>10.3f}{r['itl_p95_s']:>10.3f}{ratio}")


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _guidellm_command() -> Path | None:
    """guidellm's command: beside this interpreter (a virtualenv not on PATH), else on PATH."""
    here = Path(sys.executable).with_name("guidellm")
    found = shutil.which("guidellm")
    return here if here.exists() else (Path(found) if found else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--n", type=int, default=32, help="concurrent requests (and --max-batch)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long-prompt", type=int, default=160, help="prompt bytes of every fourth request")
    ap.add_argument("--kv-budget", type=int, default=3072, help="KV positions of every server")
    ap.add_argument("--step-tokens", type=int, default=256, help="chunked prefill budget (chunked, after)")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--guidellm", action="store_true", help="also run guidellm (pip install -e '.[bench]')")
    ap.add_argument("--guidellm-prompt", type=int, default=128, help="guidellm's synthetic prompt tokens")
    args = ap.parse_args()
    names = args.policies.split(",")
    if args.guidellm and _guidellm_command() is None:
        sys.exit("--guidellm needs guidellm: pip install -e '.[bench]'")
    context = 256
    load_before = _uptime()
    with tempfile.TemporaryDirectory(prefix="plait-bench-serve-") as tmp:
        model = Path(tmp, "bench")
        _model(model, args.dim, args.layers, context)
        if args.guidellm:
            _byte_tokenizer(model, context)
        servers = {n: Server(model, Path(tmp, f"{n}.log"), args, POLICIES[n]) for n in names}
        runs: dict[str, list[dict]] = {n: [] for n in names}
        glm: dict[str, list[dict]] = {n: [] for n in names}
        try:
            for s in servers.values():
                s.wait()
            jobs = _jobs(args.n, args.max_tokens, args.long_prompt)
            for s in servers.values():
                _load(s.url, jobs[:4])  # warm-up
            for t in range(args.trials):  # alternate the policies, rotating who goes first
                for n in names[t % len(names):] + names[: t % len(names)]:
                    runs[n].append(_load(servers[n].url, jobs))
                if args.guidellm:
                    for n in names[t % len(names):] + names[: t % len(names)]:
                        glm[n].append(_guidellm(servers[n].url, model, Path(tmp, f"g-{n}-{t}.json"), args))
        finally:
            for s in servers.values():
                s.stop()
    same = len({json.dumps(r.pop("ids")) for rs in runs.values() for r in rs}) == 1
    ours = {n: _median(rs) for n, rs in runs.items()}
    print(f"plait serve, tp {args.tp} x pp {args.pp}, {args.n} concurrent, max_tokens {args.max_tokens}, "
          f"every 4th prompt {args.long_prompt} bytes, KV {args.kv_budget} positions, step tokens "
          f"{args.step_tokens}, dim {args.dim}, {args.layers} layers, {os.cpu_count()} cores, median of "
          f"{args.trials} alternated trials; same tokens under every policy: {same}")
    print(f"load before: {load_before}\nload after:  {_uptime()}")
    _table("our client (streamed completions, most end at a stop token)", ours)
    result = {"args": vars(args), "same_tokens": same, "ours": ours, "ours_trials": runs}
    if args.guidellm:
        theirs = {n: _median(rs) for n, rs in glm.items()}
        _table(f"guidellm concurrent@{args.n} (synthetic chat, {args.guidellm_prompt} prompt tokens, "
               f"{args.max_tokens} output tokens)", theirs)
        result.update(guidellm=theirs, guidellm_trials=glm)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
