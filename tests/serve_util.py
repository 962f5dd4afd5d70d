"""Helpers of the ``plait serve`` tests: a tiny Hugging Face folder, a server subprocess on a free local port."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from plait.distributed.launch import free_port, worker_pids

if TYPE_CHECKING:
    from plait.serve.engine import Engine

PLAIT = [sys.executable, "-m", "plait.cli.main"]


def tiny_model(path: Path, newlines: bool = False) -> Path:
    """A random 4-layer byte-level Llama (GQA, context 128) saved as a Hugging Face folder.

    ``newlines``: the output row of "\n" becomes 1.05 x that of the token greedy decoding picks most, so
    that continuations hold newlines (a random model almost never writes one).
    """
    import collections

    import torch

    from plait.generation.decode import Sampling, generate_ids
    from plait.models import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=128, init_std=0.1)
    model = Llama(cfg)
    if newlines:
        outs = generate_ids(model, [list(f"prompt {i}".encode()) for i in range(16)], Sampling(8))
        common = collections.Counter(t for o in outs for t in o).most_common(1)[0][0]
        with torch.no_grad():
            model.lm_head.weight[10] = 1.05 * model.lm_head.weight[common]
    model.save_pretrained(path)
    return path


def expected_ids(model, prompt: list[int], max_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 seed: int = 0, eos: int | None = None, **sampling) -> list[int]:
    """What ``plait generate`` gives for this prompt alone (its library path, on one device), up to ``eos``."""
    from plait.generation.decode import Sampling, generate_ids

    out = generate_ids(model, [prompt], Sampling(max_tokens, temperature, top_k, seed, **sampling))[0]
    return out[: out.index(eos) + 1] if eos in out else out


def log_softmax(model, ids: list[int]):
    """Log-probabilities [len(ids), V] of the next token after each prefix, one forward on one device (float64)."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids]))[0].double(), dim=-1)


def greedy_with(model, prompt: list[int], n: int, process) -> list[int]:
    """Greedy decoding by full forwards, ``process(logits [V] float64, generated ids)`` applied before argmax."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(process(_logits(model, ids), ids[len(prompt):]).argmax()))
    return ids[len(prompt):]


def _logits(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1].double()


def listen_port() -> int:
    """A port free on 127.0.0.1 now, below the kernel's ephemeral range where it can tell (Linux): a server's
    own workers take ephemeral ports for Gloo and the rendezvous while it starts, and one of them could be
    a port the kernel had just handed out here."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return free_port()
    below = range(max(1024, low - 12000), low)
    for port in random.sample(below, min(200, len(below))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


class Server:
    """``plait serve`` as a subprocess (its own session, so the whole tree can be killed)."""

    def __init__(self, model_dir: Path, log_dir: Path, *args: str):
        self.port = listen_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"serve-{self.port}.log"
        self.proc = subprocess.Popen(PLAIT + ["serve", "--model", str(model_dir), "--port", str(self.port), *args],
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})

    def output(self) -> str:
        return self.log.read_text()

    def wait_healthy(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"plait serve exited with {self.proc.returncode}:\n{self.output()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        raise AssertionError(f"plait serve not healthy after {timeout}s:\n{self.output()}")

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise KeyError(name)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def workers(launcher_pid: int) -> list[int]:
    """The worker processes of the launcher, by pid."""
    return worker_pids(launcher_pid)


def run_waves(engine: Engine, waves: list[list[tuple]]) -> list[list[dict]]:
    """Run an in-process serving engine on a thread of its own and submit each wave of (prompt, max_tokens,
    temperature, seed) jobs once the previous one finished; each job's events."""
    from plait.generation.decode import Sampling
    from plait.serve.engine import Request
    from plait.serve.sampling import Params

    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    outs: list[list[dict]] = []
    try:
        for jobs in waves:
            done = threading.Semaphore(0)
            for prompt, n, temperature, seed in jobs:
                out: list[dict] = []
                outs.append(out)

                def sink(ev, out=out, done=done):
                    out.append(ev)
                    if ev["type"] in ("done", "error"):
                        done.release()
                engine.submit(Request(prompt, Params(Sampling(n, temperature, 0, seed)), sink))
            for _ in jobs:
                assert done.acquire(timeout=60)
    finally:
        engine.stopping.set()
        thread.join(10)
    return outs
