"""plait's processes keep the memory a step frees for the next step (``launch.keep_freed_memory``): glibc's
malloc may otherwise hand it back to the kernel, and the next step faults the same pages in again."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from plait.distributed import launch

# "Steps" as a training step's activations come and go: three 24 MiB tensors alive together, touched, then
# freed, the same sizes every step. Kept, every step after the first few reuses the heap pages the ones before
# touched: no page faults. glibc's defaults adapt their mmap threshold to the process's history (a freed block
# raises it), so whether they hand the pages back varies from run to run; the control below fixes the threshold
# at its 128 KiB default instead, so every step maps and faults its tensors afresh. What holds in every run:
# a fresh process's first tensors of this size are mapped apart by glibc's defaults and come from the heap
# with plait's settings.
PROBE = """
import ctypes, json, resource, torch
from plait.distributed.launch import keep_freed_memory
kept = keep_freed_memory()
class Mallinfo2(ctypes.Structure):  # malloc.h's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
                                               "fordblks keepcost".split()]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Mallinfo2
faults, mapped = [], []
for _ in range(STEPS):
    before, mapped_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, mallinfo2().hblkhd
    step = [torch.empty(MIB << 18).fill_(1.0) for _ in range(TENSORS)]  # [MIB * 262144] fp32 each
    mapped.append(mallinfo2().hblkhd - mapped_before)  # bytes of the step's blocks malloc mapped apart
    del step
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults, "first_step_mapped": mapped[0]}))
"""
STEPS, TENSORS, MIB = 10, 3, 24
STEADY = 5  # the last steps, counted
TOUCHED = STEADY * TENSORS * MIB * (1 << 20) // 4096  # pages those steps touch
RETURNED = "glibc.malloc.mmap_threshold=131072"  # a malloc that hands every freed tensor back to the kernel

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc parameters (Linux with glibc only)")


def _probe(extra_env: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in launch.MALLOC_ENV}
    env.update(extra_env)
    probe = PROBE.replace("STEPS", str(STEPS)).replace("TENSORS", str(TENSORS)).replace("MIB", str(MIB))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc_only
def test_freed_memory_is_kept_across_steps():
    plait = _probe({})
    default = _probe({"GLIBC_TUNABLES": ""})  # set by the user: plait leaves malloc alone
    returned = _probe({"GLIBC_TUNABLES": RETURNED})
    assert plait["kept"] is True and default["kept"] is returned["kept"] is False
    tensors = TENSORS * MIB << 20
    assert default["first_step_mapped"] >= tensors and plait["first_step_mapped"] < MIB << 20, (plait, default)
    steady = sum(plait["faults"][-STEADY:])
    assert sum(returned["faults"][-STEADY:]) > 0.9 * TOUCHED, returned  # the probe sees memory handed back
    assert steady < 0.02 * TOUCHED, (plait, TOUCHED)


def test_users_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert launch.keep_freed_memory() is False
