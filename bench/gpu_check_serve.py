"""``bench/gpu_check.py``'s serve section: ``plait serve`` on the device, answering concurrent completions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


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


def serve_section(sizes: dict, folder: Path, out: Path, env: dict, cwd: Path, concurrent: int = 32) -> dict:
    """``plait serve`` on this device, ``concurrent`` completions at once: output tokens/s over the wall time."""
    port, new = _port(), sizes["new_tokens"]
    log = (out / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "plait.cli.main", "serve", "--model", str(folder), "--port",
                               str(port), "--max-batch", str(concurrent), "--max-tokens", str(new)],
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
    return {"concurrent": concurrent, "completed": len(done), "errors": errors[:3], "output_tokens": sum(done),
            "wall_s": wall, "serve_tokens_per_s": sum(done) / wall}
