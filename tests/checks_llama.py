"""Rank-side checks: a whole Llama under TP/SP/DP equals a single-device run; bad inputs raise ConfigError."""

from __future__ import annotations

import os
from contextlib import ExitStack

import torch

import plait
from harness import rel_err, run_checks
from plait.models import Llama, LlamaConfig

BATCH, SEQ = 4, 8


def small_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=67, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
    base.update(kw)
    return LlamaConfig(**base)


def batch(cfg: LlamaConfig, seed: int = 0, ignore_some: bool = True):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    if ignore_some:
        targets[0, :3] = -100  # unequal ignored counts across DP slices
    return inputs, targets


def reference(cfg: LlamaConfig, inputs, targets, seed: int = 0):
    """Loss and gradients of the single-device model on the whole batch."""
    torch.manual_seed(seed)
    model = Llama(cfg)
    loss = model.loss(inputs, targets)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return float(loss), grads, state


def compare_llama(ctx, cfg: LlamaConfig, sp: bool = False, microbatches: int = 1) -> dict:
    inputs, targets = batch(cfg)
    ref_loss, ref_grads, ref_state = reference(cfg, inputs, targets)
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg), ctx, sequence_parallel=sp, microbatches=microbatches)
    local = slice(ctx.dp_rank * BATCH // ctx.dp_size, (ctx.dp_rank + 1) * BATCH // ctx.dp_size)
    loss = pm.train_step(inputs[local], targets[local])
    grads = pm.full_state_dict(grads=True)
    params = pm.full_state_dict()
    named = dict(Llama(cfg).named_parameters())  # keys of gradients (tied weight listed once)
    grad_errs = {k: rel_err(grads[k], ref_grads[k]) for k in named}
    return {
        "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
        "grad_rel_max": max(grad_errs.values()),
        "worst_grad": max(grad_errs, key=grad_errs.get),
        "n_grads": len(grad_errs),
        "keys_equal": sorted(params) == sorted(ref_state),
        "params_exact": max(rel_err(params[k], ref_state[k]) for k in ref_state),
    }


def check_load_roundtrip(ctx) -> dict:
    """load_full_state_dict then full_state_dict returns the same tensors (another model's weights)."""
    cfg = small_config(tie_embeddings=True)
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg), ctx)
    torch.manual_seed(123)
    other = Llama(cfg).state_dict()
    pm.load_full_state_dict(other)
    back = pm.full_state_dict()
    return {"max_err": max(rel_err(back[k], other[k]) for k in other)}


def check_eval_logits(ctx) -> dict:
    cfg = small_config()
    inputs, _ = batch(cfg)
    torch.manual_seed(0)
    ref = Llama(cfg)(inputs).detach()
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg), ctx)
    return {"logits_rel": rel_err(pm.eval_step(inputs), ref)}


def expect_config_error(fn) -> dict:
    """Run fn; report the ConfigError message (or what happened instead)."""
    try:
        fn()
    except plait.ConfigError as exc:
        return {"raised": "ConfigError", "message": str(exc)}
    except Exception as exc:  # a wrong exception type is a failure the test reports
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None, "message": ""}


def bad_input_checks(world: int) -> list:
    def bad_tokens_one_dp_rank():
        with plait.init(tp=2, pp=1, dp=world // 2) as ctx:
            cfg = small_config()
            pm = plait.parallelize(Llama(cfg), ctx)
            inputs, targets = batch(cfg)
            if ctx.dp_rank == 0:
                inputs[0, 0] = cfg.vocab_size + 5  # only one DP replica sees the bad id
            pm.train_step(inputs[:2], targets[:2])

    def model_check(**kw):
        def parallelize():
            with plait.init(tp=4, pp=1, dp=world // 4) as ctx:
                plait.parallelize(Llama(small_config(**kw)), ctx)
        return parallelize

    def load_state(change):
        """Load a tp2·pp2 model's own full state dict after ``change``: every rank, whichever stage holds the key,
        raises before writing anything (a [32, 1] tensor would otherwise broadcast into a [32, 32] one)."""
        def load():
            with plait.init(tp=2, pp=2, dp=world // 4) as ctx:
                pm = plait.parallelize(Llama(small_config()), ctx)
                state = pm.full_state_dict()
                change(state)
                pm.load_full_state_dict(state)
        return load

    return [
        ("bad/state_dict_shape", lambda: expect_config_error(load_state(
            lambda sd: sd.update({"layers.1.self_attn.q_proj.weight": torch.ones(32, 1)})))),
        ("bad/state_dict_key", lambda: expect_config_error(load_state(
            lambda sd: sd.update({"layers.2.mlp.up_proj.weight": torch.ones(64, 32)})))),
        ("bad/tp_not_dividing_world", lambda: expect_config_error(lambda: plait.init(tp=3, pp=1, dp=-1))),
        ("bad/product_mismatch", lambda: expect_config_error(lambda: plait.init(tp=2, pp=1, dp=world))),
        ("bad/heads", lambda: expect_config_error(model_check(n_heads=2, n_kv_heads=2))),
        ("bad/kv_heads", lambda: expect_config_error(model_check(dim=48, n_heads=12, n_kv_heads=3))),
        ("bad/ffn", lambda: expect_config_error(model_check(ffn_dim=90))),
        ("bad/tokens", lambda: expect_config_error(bad_tokens_one_dp_rank)),
    ]


def llama_checks(world: int, contexts: ExitStack) -> list:
    """Checks over contexts that ``contexts`` closes once they have run."""
    checks = []
    for tp in (4, 2):
        if world % tp:
            continue
        dp = world // tp
        ctx = contexts.enter_context(plait.init(tp=tp, pp=1, dp=dp))
        tag = f"tp{tp}dp{dp}"
        for sp in (False, True):
            for tied in (False, True):
                name = f"{tag}/sp{int(sp)}/tied{int(tied)}"
                checks.append((name, lambda c=ctx, s=sp, t=tied: compare_llama(c, small_config(tie_embeddings=t), s)))
        checks.append((f"{tag}/mha", lambda c=ctx: compare_llama(c, small_config(n_kv_heads=4))))
        checks.append((f"{tag}/kv1", lambda c=ctx: compare_llama(c, small_config(n_kv_heads=1), True)))
        checks.append((f"{tag}/microbatches2", lambda c=ctx: compare_llama(c, small_config(), False, 2)))
        checks.append((f"{tag}/roundtrip", lambda c=ctx: check_load_roundtrip(c)))
        checks.append((f"{tag}/eval", lambda c=ctx: check_eval_logits(c)))
    return checks


def rank_main() -> dict:
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    with ExitStack() as contexts:
        for name, fn in llama_checks(world, contexts):
            results.update(run_checks([(name, fn)]))
    results.update(run_checks(bad_input_checks(world)))
    return results
