"""Rank-side checks of training on a prepared dataset (world of 4): the same losses under every layout as on one
device, also with a chat dataset's loss mask, and a resumed run continuing the stream exactly, under its own
layout and under another."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist

from checks_train import reference_losses
from data_util import documents, write_jsonl
from harness import run_checks
from plait.data.chat import ChatSpec
from plait.train import TrainConfig
from plait.train.loop import train

STEPS = 5
LAYOUTS = {"tp2pp2": dict(tp=2, pp=2, dp=1, microbatches=2), "dp2pp2": dict(tp=1, pp=2, dp=2, microbatches=4),
           "dp2tp2": dict(tp=2, pp=1, dp=2, microbatches=1)}


def data_cfg(root: Path, name: str, **kw) -> TrainConfig:
    base = dict(seq_len=32, batch_size=8, steps=STEPS, lr=3e-3, warmup=2, clip=1.0, eval_every=STEPS, sample_tokens=0,
                trace_every=0, cluster="none", data=[str(root / "set")], checkpoint_dir=str(root / name))
    base.update(kw)
    return TrainConfig.from_dict(base)


def check_layouts(root: Path) -> dict:
    out = {}
    for name, layout in LAYOUTS.items():
        res = train(data_cfg(root, name, checkpoint_every=3, **layout))
        out[name] = {"losses": [res.losses[s] for s in range(1, STEPS + 1)], "held_out": res.held_out}
    out["single"] = reference_losses(data_cfg(root, "x"), STEPS)
    return out


def check_resume(root: Path) -> dict:
    """From the tp2pp2 run's step-3 checkpoint: resumed under tp2pp2, and under dp2tp2."""
    out = {}
    for name in ("tp2pp2", "dp2tp2"):
        if dist.get_rank() == 0:
            shutil.copytree(root / "tp2pp2" / "step_00000003", root / f"resume-{name}" / "step_00000003")
        dist.barrier()
        res = train(data_cfg(root, f"resume-{name}", resume=True, **LAYOUTS[name]))
        out[name] = {"started": min(res.losses), "losses": [res.losses[s] for s in (4, 5)]}
    return out


CHAT_LAYOUTS = {"dp2tp2": dict(tp=2, pp=1, dp=2, microbatches=2), "tp2pp2": dict(tp=2, pp=2, dp=1, microbatches=2)}


def chats(n: int) -> list[dict]:
    """Conversations of varied lengths: each window of a chat dataset holds a different share of the
    assistant's tokens."""
    docs = documents(2 * n, seed=7, max_words=12)
    return [{"messages": [{"role": "user", "content": docs[2 * i]}, {"role": "assistant", "content": docs[2 * i + 1]}]}
            for i in range(n)]


def check_chat(root: Path) -> dict:
    """A chat dataset (the loss on the assistant's tokens only): the same losses under DP, TP and PP as on one
    device (a mean over the unmasked tokens of the global batch, whatever each micro-batch and replica holds)."""
    cfg = dict(data=[str(root / "chat")], eval_every=0)
    out = {}
    for name, layout in CHAT_LAYOUTS.items():  # one run a layout, its losses at every step
        losses = train(data_cfg(root, f"chat-{name}", **cfg, **layout)).losses
        out[name] = [losses[s] for s in range(1, STEPS + 1)]
    out["single"] = reference_losses(data_cfg(root, "chat-x", **cfg), STEPS)
    return out


def rank_main(root: str) -> dict:
    import plait
    from plait.data import prepare

    plait.init(tp=1, pp=1, dp=4).close()  # the default group (which stays), for the barrier
    path = Path(root)
    if dist.get_rank() == 0:
        prepare([str(write_jsonl(path / "c.jsonl", documents(400, seed=5)))], "bytes", path / "set", workers=1,
                held_out=0.1)
        (path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats(200)))
        prepare([str(path / "chats.jsonl")], "bytes", path / "chat", workers=1, held_out=0.0, chat=ChatSpec("bytes"))
    dist.barrier()
    return run_checks([("data/layouts", lambda: check_layouts(path)), ("data/resume", lambda: check_resume(path)),
                       ("data/chat", lambda: check_chat(path))])
