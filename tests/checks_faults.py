"""Rank-side checks of the runtime's diagnostics: a silent peer produces a named timeout, not a hang."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

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
    pm.train_step(tokens[:, :-1], tokens[:, 1:])  # a first step (it also compares the ranks' batches): the peer
    if ctx.rank == 1:  # goes silent in the second
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


def lowered_timeout(done: str) -> dict:
    """A context made with a 60 s timeout, lowered to 2 s by ``set_timeout``: rank 1 joins no collective (alive
    until rank 0 has created the file ``done``, at most 30 s); rank 0's all-reduce on a group made by the context's
    ``new_group`` and on the default group (which the context's groups of 2 ranks are) each fails after about 2 s,
    not 60."""
    import torch.distributed as dist

    ctx = plait.init(dp=2, timeout_s=60.0)
    extra = ctx.new_group([0, 1])
    ctx.set_timeout(2.0)
    if ctx.rank == 1:
        deadline = time.monotonic() + 30.0
        while not Path(done).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"role": "silent"}
    waited = {}
    try:
        for name, group in (("new_group", extra), ("world", dist.group.WORLD)):
            t0 = time.monotonic()
            try:
                dist.all_reduce(torch.ones(1), group=group)
                waited[name] = None  # returned: nobody timed out
            except RuntimeError:
                waited[name] = time.monotonic() - t0
    finally:
        Path(done).touch()
    return {"role": "waiter", "waited": waited, "timeout_s": ctx.timeout_s}


def silent_decode_peer(stuck: int, after: int, done: str) -> dict:
    """``plait.generate`` over two pipeline stages where pipeline rank ``stuck`` stops answering in the decode
    loop after running ``after`` work items (alive until the other has created the file ``done``, at most
    60 s); the other must raise, naming what it waited for and the rank it waited on."""
    from plait.generation import decode, generate

    ctx = plait.init(tp=1, pp=2, dp=1, timeout_s=3.0)
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg), ctx, microbatches=1)
    if ctx.rank == stuck:
        ran, run = [0], decode.Decoder.run

        def stalling(self, c, x, caches):
            if ran[0] == after:  # alive, connected, but sends nothing more, until the waiter has its error
                deadline = time.monotonic() + 60.0
                while not Path(done).exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                raise RuntimeError("stopped answering on purpose")
            ran[0] += 1
            return run(self, c, x, caches)

        decode.Decoder.run = stalling  # type: ignore[method-assign]  # this forked rank's process only
        try:
            generate(pm, [[1, 2, 3], [4, 5, 6]], max_new_tokens=4)
        except RuntimeError:
            return {"role": "silent", "ran": ran[0]}
        return {"role": "silent", "ran": ran[0], "finished": True}
    try:
        generate(pm, [[1, 2, 3], [4, 5, 6]], max_new_tokens=4)
    except plait.CommError as exc:
        return {"role": "waiter", "raised": type(exc).__name__, "message": str(exc)}
    except RuntimeError as exc:
        return {"role": "waiter", "raised": type(exc).__name__, "message": str(exc)}
    finally:
        Path(done).touch()
    return {"role": "waiter", "raised": None, "message": ""}


def _silent_until(done: str) -> dict:
    """Stay alive and out of every collective until the file ``done`` exists (at most 60 s)."""
    deadline = time.monotonic() + 60.0
    while not Path(done).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"role": "silent"}


def _init_waiting(done: str, **layout) -> dict:
    """``plait.init(**layout)`` with a 3 s timeout while a peer stays out: what it raised and after how long; then
    the file ``done`` lets the peer go."""
    t0 = time.monotonic()
    try:
        plait.init(**layout, timeout_s=3.0)
    except RuntimeError as exc:  # plait.CommError among them
        return {"role": "waiter", "raised": type(exc).__name__, "message": str(exc), "s": time.monotonic() - t0}
    finally:
        Path(done).touch()
    return {"role": "waiter", "raised": None, "message": "", "s": time.monotonic() - t0}


def silent_at_start(done: str) -> dict:
    """Rank 1 stays out of ``plait.init`` (alive, silent) until rank 0 has created the file ``done`` (at most
    60 s); rank 0's ``plait.init`` must end within its timeout, naming the rank it waited for."""
    if int(os.environ["RANK"]) == 1:
        return _silent_until(done)
    return _init_waiting(done, dp=2)


def dead_at_collective(where: str) -> dict:
    """Rank 1 exits where rank 0 is about to wait on it in a collective: ``tp`` (tp 2: the all-reduce of a
    row-parallel layer's forward; ``tp-pp``: the same inside a pipeline action, tp 2 x pp 2), ``dp`` (dp 2: the
    gradient reduction at the end of the backward), ``norm`` (dp 2, after a whole step: the optimizer's
    gradient-norm all-reduce), ``save`` (dp 2, after a whole step: the barrier that starts a checkpoint), ``trace``
    (pp 2: the barrier that starts a traced step), ``full-state`` (pp 2, after a whole step: ``full_state_dict``'s
    all-gather), ``verify`` (dp 2: the barrier that ends plait verify's comparison), ``measure`` or ``predict``
    (dp 2: plait train's broadcast of whether to measure the host, of its prediction of the run); rank 0 must raise
    a CommError naming that collective and its group."""
    from plait.optim import ParallelOptimizer

    if where in ("verify", "measure", "predict"):
        return _dead_in_a_command(where)
    tp, pp = {"tp": (2, 1), "tp-pp": (2, 2), "trace": (1, 2), "full-state": (1, 2)}.get(where, (1, 1))
    cp = 2 if where.startswith("cp-") else 1
    ctx = plait.init(config=plait.ParallelConfig(tp=tp, pp=pp, dp=max(1, 2 // (tp * pp * cp)), cp=cp,
                                                 cp_comm=where[3:] if cp > 1 else "allgather"), timeout_s=30.0)
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8)
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg), ctx, microbatches=pp)
    opt = ParallelOptimizer(pm, torch.optim.SGD, lr=0.1, clip=1.0)
    tokens = torch.randint(0, 32, (2, 9))
    firsts = ("tp", "tp-pp", "trace", "cp-ring", "cp-allgather")
    if where in firsts:  # a first step, whose first collective compares the ranks' batches
        pm.train_step(tokens[:, :-1], tokens[:, 1:])
    if ctx.rank == 1 and where in firsts:
        os._exit(3)  # gone without a word, before its share of the (second) step
    if ctx.rank == 1 and where == "dp":  # gone in its forward, after the step's counts were agreed
        torch.nn.modules.module.register_module_forward_hook(lambda *args: os._exit(3))
    try:
        pm.train_step(tokens[:, :-1], tokens[:, 1:], trace=where == "trace")
        if ctx.rank == 1:
            os._exit(3)  # gone after the step, before the optimizer's (or the checkpoint's)
        if where == "save":
            from plait.checkpoint import save_checkpoint

            with tempfile.TemporaryDirectory(prefix="plait-dead-at-save-") as folder:
                save_checkpoint(pm, opt, folder, 1)
        if where == "full-state":
            pm.full_state_dict()
        opt.step()
    except plait.CommError as exc:
        return {"role": "waiter", "raised": type(exc).__name__, "message": str(exc)}
    except RuntimeError as exc:
        return {"role": "waiter", "raised": type(exc).__name__, "message": str(exc)}
    return {"role": "waiter", "raised": None, "message": ""}


def _dead_in_a_command(where: str) -> dict:
    from plait.cli.predict import OFF, HostPredictor
    from plait.parallel_model import ParallelModel
    from plait.verify import VerifyConfig, _rank_main

    try:
        if where == "verify":  # rank 1 gone in its logits' forward, rank 0 at the barrier that ends the comparison
            if int(os.environ["RANK"]) == 1:
                ParallelModel.eval_step = lambda *args, **kwargs: os._exit(3)  # type: ignore[method-assign]
            _rank_main(VerifyConfig(parallel=plait.ParallelConfig(tp=1, pp=1, dp=2, microbatches=1), n_layers=1,
                                    dim=16, n_heads=2, n_kv_heads=1, vocab_size=32, seq_len=8, batch_size=2))
        else:  # rank 1 gone before rank 0's word on whether to measure the host (measure) or its prediction
            ctx = plait.init(dp=2, timeout_s=30.0)
            if ctx.rank == 1:
                os._exit(3)
            run = SimpleNamespace(ctx=ctx, cfg=SimpleNamespace(cluster=None if where == "measure" else OFF))
            HostPredictor().predict(run)  # type: ignore[arg-type]
    except plait.CommError as exc:
        return {"role": "waiter", "raised": type(exc).__name__, "message": str(exc)}
    except RuntimeError as exc:
        return {"role": "waiter", "raised": type(exc).__name__, "message": str(exc)}
    return {"role": "waiter", "raised": None, "message": ""}


def init_alone(done: str) -> dict:
    """Both ranks make a first context; then rank 0 alone calls plait.init again (rank 1 stays out, alive, until
    rank 0 has created the file ``done``, at most 60 s): rank 0's plait.init must end within the default group's
    timeout, naming plait.init, not return and leave the wait to the model's first collective."""
    plait.init(dp=2, timeout_s=3.0)
    if int(os.environ["RANK"]) == 1:
        return _silent_until(done)
    return _init_waiting(done, tp=2)


def init_different_layouts() -> dict:
    """Rank 0 asks for tp 2, rank 1 for dp 2: each plait.init refuses alike, naming both layouts."""
    try:
        plait.init(tp=2, timeout_s=10.0) if int(os.environ["RANK"]) == 0 else plait.init(dp=2, timeout_s=10.0)
    except plait.ConfigError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None, "message": ""}
