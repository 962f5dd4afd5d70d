"""``plait.init`` in one process without a launcher: the default group runs over an in-process store, so the
program's environment is left as it was and no port stays open for processes it starts later to collide with."""

import json
import os
import subprocess
import sys

import pytest

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


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize("env,needle", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not"),
    ({"WORLD_SIZE": "2", "RANK": "1"}, "RANK=1, WORLD_SIZE=2 are set but MASTER_ADDR, MASTER_PORT are not"),
    ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, MASTER_PORT=29500 are set but RANK is not"),
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29500"}, "are set but MASTER_ADDR is not"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     r"RANK=2: must be from 0 to WORLD_SIZE - 1 = 1"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two': must be an integer")])
def test_an_incomplete_launch_environment_is_named_before_any_group_is_made(monkeypatch, env, needle):
    """A process whose environment has some of torchrun's variables but not all (WORLD_SIZE exported by hand, a
    launcher that sets only some) is refused by plait.init with a ConfigError naming the ones missing and the
    torchrun line, before torch.distributed is asked for a group (in this one process: no group is made)."""
    import torch.distributed as dist

    import plait

    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    made: list[object] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: made.append(kw))
    with pytest.raises(plait.ConfigError, match=needle) as info:
        plait.init(dp=-1)
    if "must be" not in needle:
        assert "launch the script with torchrun" in str(info.value) and "torchrun --nproc-per-node 2" in str(info.value)
    assert made == []
