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

# "Steps", each allocating three 8 MiB tensors, touching and freeing them, as a step's activations come and
# go; the page faults of ten steps are counted after four to settle. With glibc's defaults about 16 MiB of
# the 24 go back to the kernel at every step's end and are faulted in again by the next (4064 faults a step
# here) in most launches; in about one in four the heap's layout happens to keep them (the address space is
# randomised per launch). Kept, no launch faults after the settling.
PROBE = """
import json, resource, torch
from plait.distributed.launch import keep_freed_memory
kept = keep_freed_memory()
def step():
    tensors = [torch.empty(8 << 18).fill_(1.0) for _ in range(3)]  # 3 x [2097152] fp32, 8 MiB each
    del tensors
for _ in range(4):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""

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
    mib = (1 << 20) // 4096  # pages
    for _ in range(3):  # a launch that kept nothing would keep by chance in about one of four
        plait = _probe({})
        assert plait["kept"] is True
        assert plait["faults"] < mib, plait  # under 1 MiB faulted in over all ten steps
    defaults = []
    for _ in range(6):  # the scenario is one glibc's defaults give back in (see PROBE)
        defaults.append(_probe({"GLIBC_TUNABLES": ""}))  # set by the user: plait leaves malloc alone
        assert defaults[-1]["kept"] is False
        if defaults[-1]["faults"] > 10 * mib:  # over 1 MiB a step
            break
    else:
        pytest.fail(f"glibc's defaults kept the memory in six launches: {defaults}")


def test_users_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert launch.keep_freed_memory() is False
