"""Rank-side checks of the runtime's diagnostics: a silent peer produces a named timeout, not a hang."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import plait
from plait.models import Llama, LlamaConfig


def silent_peer(mode: str, done: str | None = None) -> dict:
    """Rank 1 never runs its stage (``stuck``: stays alive until rank 0 has created the file ``done``, at most
    60 s; ``dead``: exits); rank 0 must raise, naming it."""
    ctx = plait.init(tp=1, pp=2, dp=1, timeout_s=3.0)
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8)
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg), ctx, schedule="1f1b", microbatches=2)
    tokens = torch.randint(0, 32, (2, 9))
    if ctx.rank == 1:
        if mode == "stuck":  # alive, connected, but never sends, until the waiter has its error
            deadline = time.monotonic() + 60.0
            while done is not None and not Path(done).exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            os._exit(3)  # gone without a word
        return {"role": "silent"}
    try:
        pm.train_step(tokens[:, :-1], tokens[:, 1:])
    except plait.CommError as exc:
        return {"role": "waiter", "raised": type(exc).__name__, "message": str(exc)}
    finally:
        if done is not None:
            Path(done).touch()
    return {"role": "waiter", "raised": None, "message": ""}
