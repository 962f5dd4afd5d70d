"""Rank-side checks in a world of 8: ZeRO-1 (sharded fp32 masters) and ZeRO-2 over dp2·tp2·pp2 and dp4·tp2,
fp32 and bf16, 5 clipped AdamW steps against one device; bytes per rank against the stated formula; a
checkpoint saved under one ZeRO layout and loaded under another."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch

import plait
from checks_optim import STEPS, build, cfg_for, compare, reference, train
from harness import rel_err
from plait.checkpoint import CheckpointReader, load_checkpoint, save_checkpoint


def reshard(root: Path, a, b) -> dict:
    """3 steps under ``a`` (bf16, ZeRO-1), checkpoint; load under ``b`` (bf16, ZeRO-2) and save again: both
    checkpoints hold the same fp32 weights (the masters) and moments; then 2 more steps track one device."""
    vocab = cfg_for().vocab_size
    pm, opt = build(a, {}, zero=1, precision="bf16")
    train(a, pm, opt, range(3), vocab)
    first = save_checkpoint(pm, opt, root / "a", 3)
    pm2, opt2 = build(b, {}, zero=2, precision="bf16")
    load_checkpoint(pm2, opt2, first)
    opt2.steps = 3
    second = save_checkpoint(pm2, opt2, root / "b", 3)
    r1, r2 = CheckpointReader(first), CheckpointReader(second)
    keys = sorted(r1.meta["tensors"])
    same = keys == sorted(r2.meta["tensors"]) and all(torch.equal(r1.read(k), r2.read(k)) for k in keys)
    dtypes = {r1.meta["tensors"][k]["dtype"] for k in keys}
    losses, _ = train(b, pm2, opt2, range(3, STEPS), vocab)
    ref_state, _, ref_losses = reference()
    state = pm2.full_state_dict()
    return {"identical": same, "dtypes": sorted(dtypes), "n_optim": sum(k.startswith("optim/") for k in keys),
            "loss_rel_max": max(abs(x - r) / r for x, r in zip(losses, ref_losses[3:], strict=True)),
            "param_rel_max": max(rel_err(state[k], v) for k, v in ref_state.items())}


def checks(root: Path, contexts: ExitStack) -> list:
    """The ZeRO checks for a world of 8 (run in the launch of tests/conftest.py's ``world8``), over contexts that
    ``contexts`` closes."""
    d2 = contexts.enter_context(plait.init(tp=2, pp=2, dp=2))
    d4 = contexts.enter_context(plait.init(tp=2, pp=1, dp=4))
    tied = {"tie_embeddings": True}
    moe = {"n_experts": 4, "top_k": 2}
    d4ep = contexts.enter_context(plait.init(tp=2, pp=1, dp=4, ep=2))
    return [
        ("dp2tp2pp2/zero2/tied/sp", lambda: compare(d2, zero=2, cfg=tied, sp=True, microbatches=4)),
        # two chunks per rank, weight gradients deferred to W passes (bf16 parameters are leaves again)
        ("dp2tp2pp2/zero1/bf16/zbv", lambda: compare(d2, zero=1, precision="bf16", schedule="zbv", microbatches=4)),
        ("dp4tp2/zero2/sp", lambda: compare(d4, zero=2, sp=True)),
        ("dp4tp2/zero1/bf16", lambda: compare(d4, zero=1, precision="bf16")),
        ("dp4tp2ep2/moe/zero2", lambda: compare(d4ep, zero=2, cfg=moe)),
        ("reshard/bf16", lambda: reshard(root, d2, d4)),
    ]
