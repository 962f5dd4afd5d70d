"""``plait.init`` in one process without a launcher: the default group runs over an in-process store, so the
program's environment is left as it was and no port stays open for processes it starts later to collide with."""

import json
import os
import subprocess
import sys

PROGRAM = """
import json, os
import plait
before = dict(os.environ)
with plait.init(tp=1, pp=1, dp=1) as ctx:
    import torch, torch.distributed as dist
    t = torch.ones(2)
    dist.all_reduce(t, group=ctx.dp_group)
    print(json.dumps({"sum": t.tolist(), "world": ctx.world_size, "changed": sorted(
        k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))}))
"""


def test_init_alone_leaves_the_environment_as_it_was():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"sum": [1.0, 1.0], "world": 1, "changed": []}


def test_a_layout_of_several_processes_without_a_launcher_says_to_use_torchrun():
    """A script run with plain ``python`` is a world of 1: the error says why and how to launch it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    program = "import plait\nplait.init(tp=2, pp=2)"
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    last = out.stderr.strip().splitlines()[-1]
    assert last == ("plait.errors.ConfigError: plait.init(tp=2, pp=2) needs a multiple of 4 processes, but this "
                    "process was not started by a launcher (WORLD_SIZE is not set) and is a world of 1: run the "
                    "script under torchrun, e.g. torchrun --nproc-per-node 4 script.py"), out.stderr
