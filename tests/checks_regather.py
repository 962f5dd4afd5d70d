"""Rank side of tests/test_regather.py (world of 4): under sequence parallelism a TP region's projections keep its
input's sequence shard for the backward and all-gather it again there (plait.tensor_parallel.regather)."""

from __future__ import annotations

import weakref
from contextlib import ExitStack, contextmanager, nullcontext

import torch

import plait
from checks_pipeline import compare
from harness import rel_err, run_checks
from memory_util import saved_bytes
from plait.models import Llama, LlamaConfig
from plait.models.registry import family_of
from plait.tensor_parallel import comms
from plait.tensor_parallel.plan import apply_tp_plan
from plait.weight_grad import WeightGradStore, install

B, S, H = 2, 16, 64


@contextmanager
def counted_gathers():
    """Every ``comms.all_gather`` while inside (the SP gathers of the forward and the backward go through it):
    yields the list of weak references to their results, one per call."""
    calls: list[weakref.ref] = []
    original = comms.all_gather

    def counting(x, dim, group, **kw):  # kw: the collective's name in errors (``what``)
        out = original(x, dim, group, **kw)
        calls.append(weakref.ref(out))
        return out

    comms.all_gather = counting
    try:
        yield calls
    finally:
        comms.all_gather = original


def sp_layer(ctx, kv: int, regather: bool):
    """Decoder layer 0 of a one-layer Llama under this context's TP with SP (``n_kv_heads < tp``: replicated K, V)."""
    cfg = LlamaConfig(vocab_size=61, dim=H, n_layers=1, n_heads=4, n_kv_heads=kv, max_seq_len=S)
    torch.manual_seed(0)
    model = Llama(cfg)
    plan = family_of(model).tp_plan(model)
    assert plan is not None
    apply_tp_plan(model, plan, ctx, sequence_parallel=True, n_kv_heads=kv, regather=regather)
    return model.layers[0]


def check_layer(ctx, kv: int, deferred: bool) -> dict:
    """One layer's forward and backward on this rank's sequence shard, keeping the gathered inputs
    (``regather=False``) and keeping the shards: bytes autograd saves (each storage once), all-gathers in
    the forward and in the backward, re-gathered tensors still alive after the backward (and, with a zero-bubble
    split backward, after its W pass), and how far the gradients are apart."""
    t, r = ctx.tp_size, ctx.tp_rank
    g = torch.Generator().manual_seed(1)
    x0, dy0 = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)
    out: dict = {}
    grads = {}
    for regather in (False, True):
        layer = sp_layer(ctx, kv, regather)
        store = WeightGradStore() if deferred else None
        if store is not None:
            install(layer, store)
        x = x0.chunk(t, 1)[r].clone().requires_grad_()
        with counted_gathers() as calls:
            saved, y = saved_bytes(layer, x, layer.parameters())
            forward = len(calls)
            with store.deferring((0, 0)) if store is not None else nullcontext():
                y.backward(dy0.chunk(t, 1)[r])
            backward = calls[forward:]
            alive_i = sum(ref() is not None for ref in backward)
            w_ran = store.flush((0, 0)) if store is not None else 0
            alive_w = sum(ref() is not None for ref in backward)
        grads[regather] = [x.grad, *(p.grad for p in layer.parameters())]
        out[f"regather{int(regather)}"] = {"saved": saved, "forward_gathers": forward,
                                           "backward_gathers": len(backward), "alive_after_backward": alive_i,
                                           "w_ran": w_ran, "alive_after_w": alive_w}
    out["grad_rel"] = max(rel_err(a, b) for a, b in zip(grads[True], grads[False], strict=True))
    out["gathered_bytes"] = B * S * H * 4  # one region's gathered input [B, S, H] in float32
    out["shard_bytes"] = B * (S // t) * H * 4
    return out


def check_no_grad(ctx) -> dict:
    """Under torch.no_grad the regions gather as before and nothing is marked or kept."""
    layer = sp_layer(ctx, 2, True)
    x = torch.randn(B, S // ctx.tp_size, H)
    with counted_gathers() as calls, torch.no_grad():
        y = layer(x)
    with torch.no_grad():
        y_off = sp_layer(ctx, 2, False)(x)
    return {"gathers": len(calls), "equal": bool(torch.equal(y, y_off))}


def rank_main() -> dict:
    results: dict = {}
    with ExitStack() as contexts:
        tp2dp2 = contexts.enter_context(plait.init(tp=2, pp=1, dp=2))
        tp2pp2 = contexts.enter_context(plait.init(tp=2, pp=2, dp=1))
        checks = [(f"layer/kv{kv}/{'zb' if d else 'plain'}", lambda kv=kv, d=d: check_layer(tp2dp2, kv, d))
                  for kv in (2, 1) for d in (False, True)]
        checks.append(("no_grad", lambda: check_no_grad(tp2dp2)))
        for mode in ("none", "selective", "full"):  # single-device parity, one pipeline stage
            checks.append((f"tp2dp2sp/{mode}", lambda m=mode: compare(tp2dp2, "1f1b", microbatches=2, sp=True,
                                                                      checkpointing=m)))
        checks.append(("tp2dp2sp/kv1", lambda: compare(tp2dp2, "1f1b", microbatches=2, sp=True, n_kv_heads=1)))
        for mode in ("none", "selective", "full"):  # a zero-bubble schedule: weight gradients in W passes
            checks.append((f"tp2pp2sp/zb-h1/{mode}", lambda m=mode: compare(tp2pp2, "zb-h1", microbatches=4, sp=True,
                                                                            checkpointing=m)))
        checks.append(("tp2pp2sp/zb-h1/kv1", lambda: compare(tp2pp2, "zb-h1", microbatches=4, sp=True,
                                                               n_kv_heads=1)))
        results.update(run_checks(checks))
    return results
