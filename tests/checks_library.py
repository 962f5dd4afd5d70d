"""Rank-side checks of plait as a library in a user's own script (4 ranks): a bad evaluation batch and a model
whose context was closed are refused on every rank alike, before any collective (so no peer is left waiting)."""

from __future__ import annotations

import time

import torch

import plait
from harness import run_checks
from plait.models import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
#: a peer left waiting fails its wait after this many seconds (instead of plait's default 300), so that a check
#: whose ranks disagree ends inside its group's bound
WAIT_S = 10.0
IDS = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))


def _refusals(pm, attempts: dict) -> dict:
    """What each of ``attempts`` (name -> call) raised on this rank (type and message, or "returned") and after
    how many seconds."""
    out = {}
    for name, call in attempts.items():
        start = time.monotonic()
        try:
            call()
            out[name] = ("returned", "", 0.0)
        except Exception as exc:  # what the check reports
            out[name] = (type(exc).__name__, str(exc), time.monotonic() - start)
    return out


def bad_eval_batch() -> dict:
    """tp2·pp2: eval_step on ids outside the vocabulary (which a vocabulary-parallel embedding would mask to
    zero vectors), on floats and on one sequence without its batch dimension; then a proper batch."""
    with plait.init(tp=2, pp=2, dp=1, timeout_s=WAIT_S) as ctx:
        torch.manual_seed(0)
        pm = plait.parallelize(Llama(CFG), ctx, microbatches=2)
        x = IDS[:, :-1]
        out = _refusals(pm, {"outside": lambda: pm.eval_step(x + 64), "floats": lambda: pm.eval_step(x.float()),
                             "one row": lambda: pm.eval_step(x[0])})
        out["after"] = tuple(pm.eval_step(x).shape)
    return out


def closed_context() -> dict:
    """tp2·pp2: a model used after its context was closed (every stage's ranks alike) and after a step."""
    ctx = plait.init(tp=2, pp=2, dp=1, timeout_s=WAIT_S)
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(CFG), ctx, microbatches=2)
    x, y = IDS[:, :-1], IDS[:, 1:]
    pm.train_step(x, y)
    ctx.close()
    return _refusals(pm, {"train_step": lambda: pm.train_step(x, y), "eval_step": lambda: pm.eval_step(x),
                          "full_state_dict": pm.full_state_dict,
                          "generate": lambda: plait.generate(pm, [1, 2], max_new_tokens=2)})


def rank_main() -> dict:
    return run_checks([("bad_eval_batch", bad_eval_batch), ("closed_context", closed_context)])
