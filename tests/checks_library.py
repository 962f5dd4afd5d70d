"""Rank-side checks of plait as a library in a user's own script (4 ranks): the scripts of docs/library.md run
as shown; a bad evaluation batch and a model whose context was closed are refused on every rank alike, before any
collective (so no peer is left waiting)."""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
import time
from pathlib import Path

import torch

import plait
from harness import rel_err, run_checks
from plait.distributed.context import ParallelContext
from plait.models import Llama, LlamaConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "library.md"

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
#: a peer left waiting fails its wait after this many seconds (instead of plait's default 300), so that a check
#: whose ranks disagree ends inside its group's bound
WAIT_S = 10.0
IDS = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))


def _refusals(attempts: dict) -> dict:
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
        out = _refusals({"outside": lambda: pm.eval_step(x + 64), "floats": lambda: pm.eval_step(x.float()),
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
    return _refusals({"train_step": lambda: pm.train_step(x, y), "eval_step": lambda: pm.eval_step(x),
                          "full_state_dict": pm.full_state_dict,
                          "generate": lambda: plait.generate(pm, [1, 2], max_new_tokens=2)})


def refused_then_right() -> dict:
    """tp2·pp2: parallelize refuses a partition and a count of chunks that do not fit the model's 2 layers, then
    takes the same model with settings that fit and trains it as one device would (the refusals left it as it
    was)."""
    with plait.init(tp=2, pp=2, dp=1, timeout_s=WAIT_S) as ctx:
        torch.manual_seed(0)
        model, ref = Llama(CFG), Llama(CFG)
        ref.load_state_dict(model.state_dict())
        out = _refusals({"partition": lambda: plait.parallelize(model, ctx, partition=[2, 1]),
                         "chunks": lambda: plait.parallelize(model, ctx, schedule="interleaved-1f1b", virtual_stages=2,
                                                             microbatches=2)})
        x, y = IDS[:, :-1], IDS[:, 1:]
        out["loss"] = plait.parallelize(model, ctx, microbatches=2).train_step(x, y)
        out["one device"] = ref.loss(x, y).item()
    return out


def rows_by_rank() -> dict:
    """tp2·pp2: each rank handed rows of its own (a batch split by ctx.rank, not ctx.dp_rank), then rows whose
    length differs between the pipeline stages, prompts and sampling seeds of its own; then every rank the same."""
    with plait.init(tp=2, pp=2, dp=1, timeout_s=WAIT_S) as ctx:
        torch.manual_seed(0)
        model, ref = Llama(CFG), Llama(CFG)
        ref.load_state_dict(model.state_dict())
        pm = plait.parallelize(model, ctx, microbatches=2)
        rows = torch.randint(0, 64, (16, 9), generator=torch.Generator().manual_seed(1))
        mine, stage = rows.chunk(4)[ctx.rank], rows[:4, : 9 if ctx.pp_rank == 0 else 5]
        out = _refusals({"train_step": lambda: pm.train_step(mine[:, :-1], mine[:, 1:]),
                         "eval_step": lambda: pm.eval_step(mine[:, :-1]),
                         "stage lengths": lambda: pm.train_step(stage[:, :-1], stage[:, 1:]),
                         "generate": lambda: plait.generate(pm, [1 + ctx.rank, 2], max_new_tokens=3),
                         "generate seed": lambda: plait.generate(pm, [1, 2], max_new_tokens=3, temperature=1.0,
                                                                 seed=ctx.rank)})
        x, y = rows[:4, :-1], rows[:4, 1:]
        out["loss"], out["one device"] = pm.train_step(x, y), ref.loss(x, y).item()
        out["generated"], out["generated on one device"] = (plait.generate(m, [1, 2], max_new_tokens=3)
                                                            for m in (pm, ref))
    return out


def zero_grads() -> dict:
    """pp2·dp2: the gradients full_state_dict(grads=True) gives after a step, under a zero=0 optimizer and a
    zero=1 one, beside one device's."""
    from plait.optim import ParallelOptimizer

    out = {}
    torch.manual_seed(0)
    ref = Llama(CFG)
    x, y = IDS[:, :-1], IDS[:, 1:]
    ref.loss(x, y).backward()
    for zero in (0, 1):
        with plait.init(tp=1, pp=2, dp=2, timeout_s=WAIT_S) as ctx:
            model = Llama(CFG)
            model.load_state_dict(ref.state_dict())
            pm = plait.parallelize(model, ctx, microbatches=2)
            ParallelOptimizer(pm, torch.optim.SGD, lr=0.1, zero=zero)
            pm.train_step(x.chunk(2)[ctx.dp_rank], y.chunk(2)[ctx.dp_rank])
            try:
                grads = pm.full_state_dict(grads=True)
                out[zero] = max(rel_err(grads[k], p.grad) for k, p in ref.named_parameters())
            except plait.ConfigError as exc:
                out[zero] = str(exc)
    return out


def doc_scripts() -> list[tuple[str, str, str]]:
    """(name, code, the output shown after it) of each ``python`` block of docs/library.md: a script named by its
    first line (``# train.py — run with: ...``), the plain block that follows it its rank 0's output."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", DOC.read_text(), flags=re.S | re.M)
    out = []
    for (kind, code), (_, shown) in itertools.pairwise(blocks):
        if kind == "python":
            name = re.match(r"# (\S+\.py) ", code)
            assert name, f"docs/library.md: a python block that does not start with '# NAME.py ': {code[:60]!r}"
            out.append((name.group(1), code, shown))
    return out


def run_script(name: str, code: str, folder: str) -> str:
    """What ``code`` printed, run as ``python name`` would run it on this rank, in a folder of its own; the
    contexts it left open are closed after it."""
    here, printed, namespace = os.getcwd(), io.StringIO(), {"__name__": "__main__"}
    os.makedirs(Path(folder, name), exist_ok=True)
    os.chdir(Path(folder, name))
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"docs/library.md: {name}", "exec"), namespace)
    finally:
        os.chdir(here)
        for value in namespace.values():
            if isinstance(value, ParallelContext):
                value.close()
    return printed.getvalue()


def rank_main(folder: str) -> dict:
    docs = [(f"docs: {name}", lambda n=name, c=code: run_script(n, c, folder)) for name, code, _ in doc_scripts()]
    return run_checks([*docs, ("bad_eval_batch", bad_eval_batch), ("closed_context", closed_context),
                       ("refused_then_right", refused_then_right), ("rows_by_rank", rows_by_rank),
                       ("zero_grads", zero_grads)])
