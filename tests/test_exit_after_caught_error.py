"""A torchrun script that catches plait's ConfigError and ends normally, without ctx.close() or
destroy_process_group, exits 0 on every rank: the default group plait.init made is destroyed at the program's exit,
before the interpreter's finalization (left to it, a Gloo group sometimes aborted the process with "terminate
called without an active exception")."""

import subprocess
import sys

SCRIPT = """
import atexit, os
import torch.distributed as dist
def say(line):
    with open(f"rank{os.environ['RANK']}.txt", "a") as f:
        f.write(line + "\\n")
atexit.register(lambda: say(f"default group alive at exit: {dist.is_initialized()}"))  # registered first: runs last
import torch, plait
from plait.models import Llama, LlamaConfig
ctx = plait.init(tp=2, timeout_s=60)
torch.manual_seed(0)
pm = plait.parallelize(Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=32)), ctx)
rows = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(ctx.rank))  # each rank its own rows
try:
    pm.train_step(rows[:, :-1], rows[:, 1:])
except plait.ConfigError as exc:
    say(f"caught: {str(exc).split(' (')[0]}")
"""


def test_a_script_that_catches_a_config_error_and_returns_exits_cleanly(tmp_path):
    script = tmp_path / "caught.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-3000:]
    assert "terminate called" not in said, said[-3000:]
    for rank in (0, 1):  # the abort comes only now and then: that the group is gone at exit is what holds always
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert lines == ["caught: the ranks of data-parallel replica 0 were handed different batches",
                         "default group alive at exit: False"], (rank, lines, said[-3000:])
