"""The README's quickstart runs under torchrun and trains exactly like one device would."""

import re
import subprocess
import sys
from pathlib import Path

import torch

from plait.models import Llama, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]


def _single_device_losses() -> list[float]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_quickstart_under_torchrun_matches_one_device():
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "4", str(ROOT / "examples/quickstart.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 5, proc.stdout
    expected = _single_device_losses()
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) / want < 1e-4, (losses, expected)  # printed with 4 decimals
    assert losses[-1] < losses[0]
