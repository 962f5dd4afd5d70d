"""A process killed by SIGKILL in the middle of writing its second checkpoint, and the checks that the first one
survived whole (the synchronous save in test_train_cli, the background write in test_recovery)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

CONFIG = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4)

# a seeded tiny model on one process; after hang_in_writes() every later checkpoint write prints "writing" once
# its first file is synced, then sleeps (the kill lands inside the write)
PRELUDE = textwrap.dedent(f"""
    import sys, time, torch
    import plait
    from plait.checkpoint import writer
    from plait.models import Llama, LlamaConfig
    ctx = plait.init(1, 1, 1)
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(LlamaConfig(**{CONFIG!r})), ctx)
    def hang_in_writes():
        real = writer.fsync_path
        def slow(path):
            real(path)
            print("writing", flush=True)
            time.sleep(60)
        writer.fsync_path = slow
""")


def kill_inside_second_save(body: str, ck: Path, said: set[str]) -> None:
    """Runs ``PRELUDE`` + ``body`` (the checkpoint folder is ``sys.argv[1]``) until it has printed the lines
    ``said`` (in any order), checks that step 2's temporary folder is there, and kills it with SIGKILL."""
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent(body), str(ck)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        got = {proc.stdout.readline().strip() for _ in said}
        assert got == said, got
        assert (ck / ".step_00000002.tmp").is_dir()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def assert_first_checkpoint_whole(ck: Path) -> None:
    """Step 1 is the latest complete checkpoint and holds the seeded model exactly."""
    import torch

    from plait.checkpoint import CheckpointReader, find_checkpoint
    from plait.models import Llama, LlamaConfig

    found = find_checkpoint(ck)
    assert found is not None and found.name == "step_00000001", found
    assert (ck / "latest").read_text().strip() == "step_00000001"
    state = CheckpointReader(found).full_state_dict()
    torch.manual_seed(0)
    ref = Llama(LlamaConfig(**CONFIG)).state_dict()
    assert set(state) == set(ref) and all(torch.equal(state[k], ref[k]) for k in ref)
