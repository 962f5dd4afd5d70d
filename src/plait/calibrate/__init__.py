"""``plait calibrate``: measure this host (kernels, collectives) with plait's own processes, write a profile.

The measuring runs on local Gloo processes (NCCL with GPUs) started by ``plait.distributed.launch``; the
profile it writes (``plait.plan.profile``, TOML) is what ``plait plan --cluster FILE`` and ``plait train``
read. One launch of the largest process count measures every section: for ``P`` processes, ranks
``0..P-1`` take the thread count ``plait train`` gives them and the other ranks wait at a barrier.
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
from pathlib import Path

from plait.plan.profile import HostProfile

DEFAULT_PROCESSES = (1, 2, 4)
CACHE_ENV = "PLAIT_CACHE_DIR"


def host_facts() -> dict:
    """What identifies this host's speed: name, CPU, usable cores, memory, torch, backend and device."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    cuda = torch.cuda.is_available()
    return {"hostname": socket.gethostname(), "cpu": cpu, "cores": cores, "memory_bytes": memory,
            "torch": torch.__version__, "backend": "nccl" if cuda else "gloo",
            "device": torch.cuda.get_device_name(0) if cuda else "cpu"}


def host_key(facts: dict) -> str:
    """A short key of the facts that change speeds (a new torch, CPU or core count: a new profile)."""
    text = "|".join(str(facts.get(k)) for k in ("hostname", "cpu", "cores", "memory_bytes", "torch", "backend",
                                                 "device"))
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def cache_dir() -> Path:
    """``$PLAIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/plait``, else ``~/.cache/plait``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "plait"


def cache_path(facts: dict | None = None) -> Path:
    """Where this host's profile is cached."""
    facts = facts or host_facts()
    return cache_dir() / f"host-{host_key(facts)}.toml"


def calibrate(processes: tuple[int, ...] = DEFAULT_PROCESSES, out: str | Path | None = None,
              progress=None) -> tuple[HostProfile, Path]:
    """Measure ``processes`` (one section each) on local processes; write the profile to ``out`` (default:
    this host's cache, merged with what it already holds). ``progress(done, total, what)`` is called
    while it measures. Returns the profile and where it was written."""
    import tempfile
    import threading
    import time

    from plait.calibrate.run import measure_world, total_steps
    from plait.distributed.launch import run_world

    counts = sorted({int(p) for p in processes})
    world = max(counts)
    with tempfile.TemporaryDirectory(prefix="plait-calibrate-") as tmp:
        ticks = Path(tmp) / "progress"
        box: dict = {}

        def work() -> None:
            try:
                box["result"] = run_world(measure_world, world, counts, str(ticks), timeout_s=600.0)[0]
            except BaseException as exc:  # re-raised in the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        total = total_steps(counts)
        while thread.is_alive():
            thread.join(0.2)
            if progress is not None and ticks.exists():
                lines = ticks.read_text().splitlines()
                progress(len(lines), total, lines[-1] if lines else "starting")
            time.sleep(0.05)
        if "error" in box:
            raise box["error"]
    measured = box["result"]
    path = Path(out) if out is not None else cache_path(measured.host)
    if out is None and path.is_file():
        measured = HostProfile.load(path).merged(measured)
    measured.save(path)
    return measured, path
