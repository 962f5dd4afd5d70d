"""``plait calibrate``: measure this host (kernels, collectives) with plait's own processes, write a profile.

The measuring runs on local Gloo processes (NCCL with GPUs) started by ``plait.distributed.launch``; the
profile it writes (``plait.plan.host.profile``, TOML) is what ``plait plan --cluster FILE`` and ``plait train``
read. Each section (a process count) is measured in a launch of that many processes, each taking the
thread count ``plait train`` gives it: a run of ``P`` processes is a world of ``P``, and a section measured
with more processes in its world, idle at a barrier, times its tensor-parallel collectives differently
(docs/planner-log.md, entry 13).
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
from collections.abc import Callable
from pathlib import Path

from plait.errors import ConfigError, FieldError
from plait.plan.host.profile import HOST_KEYS, HostProfile

DEFAULT_PROCESSES = (1, 2, 4)
CACHE_ENV = "PLAIT_CACHE_DIR"
# imported once for the calibration's launches (``run_world``); torch._dynamo: the optimizer step's AdamW imports it
# when it is made (~2 s of CPU a process otherwise)
PRELOAD = ("torch", "torch._dynamo", "plait.calibrate.run")


def usable_cores() -> int:
    """The cores this process may run on (its affinity; every core where that is not known)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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
    cores = usable_cores()
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
    text = "|".join(str(facts.get(k)) for k in HOST_KEYS)
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
              progress: Callable[[int, int, str], None] | None = None, repeat: int = 1,
              add: bool = False) -> tuple[HostProfile, Path]:
    """Measure ``processes`` (one section each) on local processes ``repeat`` times and write the mean
    (``HostProfile.average``) to ``out`` (default: this host's cache, merged with what it already holds).
    ``add`` averages it with the calibrations ``out`` already holds instead of replacing them: a host whose
    speed moves over minutes is best predicted by calibrations taken at several moments. With ``add`` the profile
    must exist (a FieldError naming ``add`` before anything is measured): a missing one is a mistyped path far more
    often than a wish to start afresh.
    ``progress(done, total, what)`` is called while it measures. Returns the profile and where it was
    written."""
    from plait.calibrate.run import total_steps

    if repeat < 1:
        raise ConfigError(f"repeat: give a count >= 1, not {repeat}")
    refuse_gpu_host()
    if add:
        held = Path(out) if out is not None else cache_path()
        if not held.is_file():
            raise FieldError("add", True, f"nothing to average with: {held} does not exist (calibrate once "
                                          "without it to make the profile, then add to it)")
    counts = sorted({int(p) for p in processes})
    per = total_steps(counts)

    def report(i: int):
        if progress is None:
            return None
        label = f"calibration {i + 1} of {repeat}: " if repeat > 1 else ""
        return lambda done, what: progress(per * i + done, per * repeat, label + what)

    runs = [_measure_once(counts, report(i)) for i in range(repeat)]
    measured = HostProfile.average(runs) if repeat > 1 else runs[0]
    path = Path(out) if out is not None else cache_path(measured.host)
    if path.is_file() and add:
        measured = HostProfile.average([HostProfile.load(path), measured])
    elif path.is_file() and out is None:
        measured = HostProfile.load(path).merged(measured)
    measured.save(path)
    return measured, path


def refuse_gpu_host() -> None:
    """ConfigError on a host with a GPU: the calibration's kernels are sized for CPU cores, far below the sizes a
    GPU needs to reach its speed, so its profile would cost GPU steps many times too slow (on an H200 it put a
    0.14 s step at 6.8 s). GPU runs are costed by the planner's GPU model instead."""
    from plait.devices import accelerator_name

    gpu = accelerator_name()
    if gpu is not None:
        raise ConfigError(f"calibrate: this host has a GPU ({gpu}); plait calibrate measures plait's processes "
                          "on CPU cores and cannot cost GPU steps. GPU runs are predicted by the planner's GPU "
                          "model: plait train uses it by default here, and plait plan --gpu NAME plans with it")


def _measure_once(counts: list[int], progress) -> HostProfile:
    """One calibration of ``counts``, each count in a launch of that many local processes (smallest first);
    ``progress(done, what)`` while it runs."""
    import tempfile
    import threading
    import time

    from plait.calibrate.run import Measured, assemble, measure_world
    from plait.distributed.launch import run_world

    with tempfile.TemporaryDirectory(prefix="plait-calibrate-") as tmp:
        ticks = Path(tmp) / "progress"
        box: dict = {}

        def work() -> None:
            try:
                measured: dict[int, Measured] = {}
                for p in counts:
                    measured[p] = run_world(measure_world, p, p, str(ticks), timeout_s=600.0, preload=PRELOAD)[0]
                box["result"] = assemble(measured, host_facts())
            except BaseException as exc:  # re-raised in the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=work, daemon=True)
        if progress is not None:  # the first figure comes after the processes import torch: seconds, more when busy
            progress(0, "starting the processes")
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if progress is not None and ticks.exists():
                lines = ticks.read_text().splitlines()
                progress(len(lines), lines[-1] if lines else "starting")
            time.sleep(0.05)
        if "error" in box:
            raise box["error"]
    return box["result"]
