"""plait's processes keep the memory a step frees for the next step (``launch.keep_freed_memory``): glibc's
malloc otherwise hands it back to the kernel and the next step faults the same pages in again."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from plait.distributed import launch

# "Steps", each allocating one tensor, touching and freeing it, as a step's activations come and go; the
# tensor grows by 1 MiB a step (5 to 14 MiB over the ten counted, after four of 1-4 MiB). With glibc's
# defaults each one is over the threshold the last free raised, so it comes from fresh mmap pages: every
# 4 KiB faults (24330 faults here, every launch). Kept, each comes from the heap, whose pages the steps
# before touched: only its growth faults in (6912-7680).
PROBE = """
import json, resource, torch
from plait.distributed.launch import keep_freed_memory
kept = keep_freed_memory()
def step(mib):
    t = torch.empty(mib << 18).fill_(1.0)  # [mib * 262144] fp32, mib MiB
    del t
for mib in range(1, 5):
    step(mib)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for mib in range(5, 15):
    step(mib)
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""
TOUCHED = sum(range(5, 15)) * (1 << 20) // 4096  # pages the ten counted steps touch

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc parameters (Linux with glibc only)")


def _probe(extra_env: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in launch.MALLOC_ENV}
    env.update(extra_env)
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc_only
def test_freed_memory_is_kept_across_steps():
    plait = _probe({})
    default = _probe({"GLIBC_TUNABLES": ""})  # set by the user: plait leaves malloc alone
    assert plait["kept"] is True and default["kept"] is False
    assert default["faults"] > 0.9 * TOUCHED, default  # glibc's defaults: every page comes fresh
    assert plait["faults"] < 0.5 * default["faults"], (plait, default)


def test_users_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert launch.keep_freed_memory() is False
