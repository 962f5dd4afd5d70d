"""``bench/gpu_check.py``'s serve and serve_step sections: ``plait serve`` on the device answering concurrent
completions, and the serving runner's decode step on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _port() -> int:
    """A free port below the ephemeral range (the server's own Gloo listeners take ephemeral ones)."""
    import random
    import socket

    for port in random.Random(os.getpid()).sample(range(20000, 30000), 50):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port between 20000 and 30000")


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def serve_section(sizes: dict, folder: Path, out: Path, env: dict, cwd: Path, dtype: str,
                  concurrent: int = 32) -> dict:
    """``plait serve --dtype dtype`` (on the GPU where there is one), ``concurrent`` completions at once: output
    tokens/s over the wall time, and the server's first line (where it runs, in which dtype)."""
    port, new = _port(), sizes["new_tokens"]
    log = (out / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "plait.cli.main", "serve", "--model", str(folder), "--port",
                               str(port), "--max-batch", str(concurrent), "--max-tokens", str(new), "--dtype", dtype],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"plait serve exited {server.returncode}: {(out / 'serve.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{base}/v1/models", timeout=5).read()
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("plait serve did not answer within 300 s") from None
                time.sleep(1)
        body = {"prompt": "def fibonacci(n):" * 4, "max_tokens": new, "temperature": 0.0}
        _post(f"{base}/v1/completions", dict(body, max_tokens=2))  # warm-up
        done: list[int] = []
        errors: list[str] = []

        def one() -> None:
            try:
                done.append(_post(f"{base}/v1/completions", body)["usage"]["completion_tokens"])
            except Exception as exc:  # recorded in the section's result
                errors.append(repr(exc))

        threads = [threading.Thread(target=one) for _ in range(concurrent)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    first = (out / "serve.log").read_text().partition("\n")[0]
    return {"concurrent": concurrent, "completed": len(done), "errors": errors[:3], "output_tokens": sum(done),
            "wall_s": wall, "serve_tokens_per_s": sum(done) / wall, "server": first}


def serve_step_section(device, sizes: dict, folder: Path, out: Path, profile: Callable[[dict, Path, Any], None],
                       rows: int = 32) -> dict:
    """The serving runner's decode step on its own (``serve.runner.Runner.execute``: no HTTP, no scheduler, no
    hand-over) at ``rows`` greedy rows of 68-token prompts, beside a decode step of batched ``plait.generate`` on
    the same prompts: where the serve section's time per token goes that the model's step does not explain.

    Each decode runs twice: ``cold``, the first time this process meets its steps' shapes (a server's case; a GPU's
    attention may prepare a plan per shape, cuDNN's does), and ``warm``, the same shapes again. The runner runs
    with its keys' length rounded (``serve.kv.PagedBatch.round_keys``, a GPU's default) and then exact (one more
    key every step), and ``plait.generate``'s step is taken from its first run (cold) and its best of 3 (warm). A
    prefill and three decode steps of the runner go through ``profile`` (``gpu_check``'s) to
    ``serve_profile.txt``."""
    import torch

    import plait
    from plait.devices import synchronize
    from plait.generation.decode import Sampling
    from plait.models import Llama
    from plait.serve.runner import Row, Runner, Step
    from plait.serve.sampling import Params

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Llama.from_pretrained(folder, dtype=dtype).to(device).eval()
    prompt, new, block = 68, sizes["new_tokens"], 16
    per = (prompt + new + block - 1) // block
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (rows, prompt), generator=g).tolist()
    tables = [list(range(i * per, (i + 1) * per)) for i in range(rows)]

    def decode(steps: int, round_keys: bool | None = None) -> list[float]:
        """Prefill every row in one step, then ``steps`` decode steps: each one's seconds (``round_keys``: the
        runner's setting, None: its default on this device)."""
        runner = Runner(model, num_blocks=rows * per + 1, block_size=block)
        if round_keys is not None:
            runner.batch.round_keys = round_keys
        outs = runner.execute(Step(new=[(i, Params(Sampling(new, 0.0))) for i in range(rows)],
                                   rows=[Row(i, prompts[i], 0, tables[i], True) for i in range(rows)]))
        times = []
        for s in range(steps):
            step = Step(rows=[Row(i, [outs[i][0]], prompt + s, tables[i], True) for i in range(rows)])
            synchronize(device)
            t0 = time.perf_counter()
            outs = runner.execute(step)
            synchronize(device)
            times.append(time.perf_counter() - t0)
        return times

    def ms(times: list[float]) -> dict:
        times = sorted(times)
        return {"median_ms": 1e3 * times[len(times) // 2], "min_ms": 1e3 * times[0], "max_ms": 1e3 * times[-1]}

    decode(1)  # warm-up: kernels, allocator (the prefill's shapes and one decode step's)
    rounded = {"cold": ms(decode(new - 1, True)), "warm": ms(decode(new - 1, True))}
    exact = {"cold": ms(decode(new - 1, False)), "warm": ms(decode(new - 1, False))}
    profile({"serving runner, prefill and 3 decode steps": lambda: decode(3)}, out / "serve_profile.txt", device)

    def generate(n: int) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        plait.generate(model, prompts, max_new_tokens=n)
        synchronize(device)
        return time.perf_counter() - t0

    short = generate(2)  # warm-up: the prefill's shape and the first decode step's
    cold = generate(new)  # its decode steps' shapes met for the first time
    generated = {2: min(short, generate(2)), new: cold}
    for _ in range(3):  # batched decoding's step: the best of 3 runs of each length, their difference per token
        for n in generated:
            generated[n] = min(generated[n], generate(n))
    warm_ms = 1e3 * (generated[new] - generated[2]) / (new - 2)
    cold_ms = 1e3 * (cold - generated[2]) / (new - 2)
    return {"rows": rows, "dtype": str(dtype).replace("torch.", ""),
            "round_keys_default": Runner(model, num_blocks=1, block_size=block).batch.round_keys,
            "runner_decode_step_ms": rounded["cold"]["median_ms"],
            "runner_decode_step_min_ms": rounded["cold"]["min_ms"],
            "runner_decode_step_warm_ms": rounded["warm"]["median_ms"],
            "runner_exact_keys_decode_step_ms": exact["cold"]["median_ms"],
            "runner_exact_keys_decode_step_warm_ms": exact["warm"]["median_ms"],
            "runner_rounded_keys": rounded, "runner_exact_keys": exact,
            # None where the runs' scatter (a loaded host) exceeds the extra tokens' time
            "generate_decode_step_ms": warm_ms if warm_ms > 0 else None,
            "generate_decode_step_cold_ms": cold_ms if cold_ms > 0 else None}
