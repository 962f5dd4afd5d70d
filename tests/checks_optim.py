"""Rank-side checks: 5 clipped AdamW steps over TP/PP/DP (ZeRO-1, tied, replicated KV, bf16) equal one device."""

from __future__ import annotations

import io
from contextlib import ExitStack
from functools import cache

import torch

import plait
from harness import rel_err, run_checks
from plait.data_parallel.reducer import grad_group, set_grad_group
from plait.models import Llama, LlamaConfig
from plait.optim import ParallelOptimizer, lr_at, param_groups

BATCH, SEQ, STEPS = 8, 8, 5
LR, WD, BETAS, EPS, WARMUP = 3e-3, 0.1, (0.9, 0.95), 1e-6, 2
# eps=1e-6, not 1e-8: AdamW's first update lr·g/(|g|+eps) is ill-conditioned where a clipped gradient is
# near eps, and with eps=1e-8 fp32 reduction-order rounding (~1e-9 absolute) then shows as 5e-5 in the
# parameters after one step (measured); with 1e-6 the comparison stays at rounding level (1e-5).
CLIP = 0.05  # below every step's gradient norm (the test asserts it): clipping is active at every step


def cfg_for(**kw) -> LlamaConfig:
    base = dict(vocab_size=61, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)  # 61: padded
    base.update(kw)
    return LlamaConfig(**base)


def batch(vocab: int, step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    targets[1, :2] = -100
    return inputs, targets


@cache
def reference(**cfg_kw) -> tuple[dict, list[float], list[float]]:
    """Single device: AdamW with the same groups and schedule, torch.nn.utils.clip_grad_norm_."""
    cfg = cfg_for(**cfg_kw)
    torch.manual_seed(0)
    model = Llama(cfg)
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), WD), lr=LR, betas=BETAS, eps=EPS)
    norms, losses = [], []
    for k in range(STEPS):
        inputs, targets = batch(cfg.vocab_size, k)
        opt.zero_grad()
        loss = model.loss(inputs, targets)
        loss.backward()
        losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        for group in opt.param_groups:
            group["lr"] = lr_at(k, LR, WARMUP, STEPS)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, losses


def build(ctx, cfg_kw: dict, zero: int = 0, precision: str = "fp32", microbatches: int = 2, sp: bool = False,
          reduce_scatter: bool = True, own_group: tuple[str, ...] = (), schedule: str = "1f1b",
          recompute: str = "none"):
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg_for(**cfg_kw)), ctx, schedule=schedule, microbatches=microbatches,
                           sequence_parallel=sp, precision=precision, zero=zero, activation_checkpointing=recompute)
    for name, p in pm.named_model_parameters():  # reduced over "their own" group, as experts are (here: DP)
        if name in own_group:
            set_grad_group(p, ctx.dp_group, ctx.dp_size)
    opt = ParallelOptimizer(pm, torch.optim.AdamW, lr=LR, weight_decay=WD, betas=BETAS, eps=EPS, zero=zero,
                            warmup=WARMUP, total_steps=STEPS, reduce_scatter=reduce_scatter)
    return pm, opt


def train(ctx, pm, opt, steps: range, vocab: int) -> tuple[list[float], list[float]]:
    per = BATCH // ctx.dp_size
    local = slice(ctx.dp_rank * per, (ctx.dp_rank + 1) * per)
    losses, norms = [], []
    for k in steps:
        inputs, targets = batch(vocab, k)
        losses.append(pm.train_step(inputs[local], targets[local]))
        norms.append(opt.clip_grad_norm_(CLIP))
        opt.step()
    return losses, norms


def padding_rows_zero(pm) -> bool | None:
    """The padded vocabulary rows (last TP rank) are still exactly zero; None where there are none."""
    ctx = pm.ctx
    with pm.full_parameters():  # ZeRO-3: gathered (collective)
        if ctx.tp_size == 1 or ctx.tp_rank != ctx.tp_size - 1:
            return None
        rows = [p[-1] for k, p in pm.named_model_parameters() if k in ("embed_tokens.weight", "lm_head.weight")]
        return all(bool((r == 0).all()) for r in rows) if rows else None


def miscounted_norm_rel(opt) -> float:
    """Relative change of the norm if every local element were counted (replicas and tied copies too)."""
    right = opt.grad_norm()
    saved = [pc.counted for pc in opt.layout.pieces]
    for pc in opt.layout.pieces:
        pc.counted = True
    wrong = opt.grad_norm()
    for pc, c in zip(opt.layout.pieces, saved, strict=True):
        pc.counted = c
    return abs(wrong - right) / right


def compare(ctx, precision: str = "fp32", **kw) -> dict:
    return measure(ctx, precision, **kw)[0]


def measure(ctx, precision: str = "fp32", **kw) -> tuple[dict, object, ParallelOptimizer]:
    """``compare``'s figures, with the trained model and optimizer."""
    cfg_kw = kw.pop("cfg", {})
    ref_state, ref_norms, ref_losses = reference(**cfg_kw)
    pm, opt = build(ctx, cfg_kw, precision=precision, **kw)
    losses, norms = train(ctx, pm, opt, range(STEPS), cfg_for(**cfg_kw).vocab_size)
    state = pm.full_state_dict()
    errs = {k: rel_err(state[k], v) for k, v in ref_state.items()}
    miscount = miscounted_norm_rel(opt)
    return {
        "param_rel_max": max(errs.values()), "worst": max(errs, key=errs.get),
        "norm_rel_max": max(abs(n - r) / r for n, r in zip(norms, ref_norms, strict=True)),
        "loss_rel_max": max(abs(n - r) / r for n, r in zip(losses, ref_losses, strict=True)),
        "ref_norms": ref_norms, "ref_losses": ref_losses, "losses": losses,
        "pad_zero": padding_rows_zero(pm), "state_bytes": opt.state_bytes(),
        "local_params": sum(p.numel() for _, p in pm.named_model_parameters()), "miscount_rel": miscount,
        "n_own": len({id(p) for _, b in opt.layout.buckets for p in b.params if grad_group(p) is not None}),
        "memory": pm.memory_report(), "formula": formula_bytes(pm, opt), "n_buckets": len(pm.grad_buckets()),
    }, pm, opt


def formula_bytes(pm, opt) -> dict:
    """The per-rank bytes docs/optim.md states, from the bucket geometry alone (d = the bucket's group size):
    params 4 B/elt (2 with bf16 parameters; ZeRO-3: 4·padded/d per bucket, the float32 shards); grads
    4·padded per bucket (ZeRO-2/3: 4·padded/d); optimizer (AdamW) zero 0: 8 B/elt + 4 B per tensor (step),
    zero 1/2/3: (8, +4 with separate bf16 masters under ZeRO-1/2) B per owned element + 4 B per owned piece."""
    bf16_params = opt.zero in (1, 2) and pm.precision == "bf16"
    params = list(pm.parameters())
    buckets = [b for _, b in pm.grad_buckets()]
    out = {"params": sum(p.numel() for p in params) * (2 if bf16_params else 4)}
    if opt.zero == 3:
        out["params"] = 4 * sum(b.padded // b.size for b in buckets)
    out["grads"] = 4 * sum(b.padded // b.size if opt.zero >= 2 else b.padded for b in buckets)
    if opt.zero == 0:
        out["optimizer"] = 8 * sum(p.numel() for p in params) + 4 * len(params)
        return out
    owned = pieces = 0
    for b in buckets:  # this rank's shard [index·padded/d, (index+1)·padded/d) without the padding
        lo, hi = b.index * b.padded // b.size, min((b.index + 1) * b.padded // b.size, b.numel)
        for p, off in zip(b.params, b.offsets, strict=True):
            n = min(off + p.numel(), hi) - max(off, lo)
            if n > 0:
                owned, pieces = owned + n, pieces + 1
    out["optimizer"] = (12 if bf16_params else 8) * owned + 4 * pieces
    out["owned"] = owned
    return out


def resume(ctx, **kw) -> dict:
    """3 steps, save model + per-rank optimizer state, rebuild, load, 2 more steps == 5 uninterrupted."""
    cfg_kw = kw.pop("cfg", {})
    ref_state = reference(**cfg_kw)[0]
    vocab = cfg_for(**cfg_kw).vocab_size
    pm, opt = build(ctx, cfg_kw, **kw)
    train(ctx, pm, opt, range(3), vocab)
    buf = io.BytesIO()
    torch.save({"model": pm.full_state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    pm2, opt2 = build(ctx, cfg_kw, **kw)
    pm2.load_full_state_dict(saved["model"])
    opt2.load_state_dict(saved["optim"])
    train(ctx, pm2, opt2, range(3, STEPS), vocab)
    state = pm2.full_state_dict()
    return {"param_rel_max": max(rel_err(state[k], v) for k, v in ref_state.items()), "steps": opt2.steps}


def gathered(ctx) -> dict:
    """ZeRO-1's per-parameter gathered state equals the unsharded optimizer's; resuming from it is exact."""
    ref_state = reference()[0]
    named_state = {}
    for zero in (0, 1):
        pm, opt = build(ctx, {}, zero=zero)
        train(ctx, pm, opt, range(3), 61)
        st = opt.gathered_state()
        named_state[zero] = {n: st[p] for n, p in pm.named_parameters()}
    moments = ("exp_avg", "exp_avg_sq")
    err = max(rel_err(named_state[1][n][k], named_state[0][n][k]) for n in named_state[0] for k in moments)
    steps_equal = all(float(named_state[1][n]["step"]) == 3.0 for n in named_state[1])
    pm2, opt2 = build(ctx, {}, zero=1)
    pm2.load_full_state_dict(pm.full_state_dict())
    opt2.load_gathered_state({p: named_state[1][n] for n, p in pm2.named_parameters()})
    opt2.steps = 3
    train(ctx, pm2, opt2, range(3, STEPS), 61)
    final = pm2.full_state_dict()
    return {"moments_rel": err, "steps_equal": steps_equal,
            "param_rel_max": max(rel_err(final[k], v) for k, v in ref_state.items())}


class Square(torch.nn.Module):
    """Squares the first quarter of its input's features: ``a * a`` saves the view ``a`` twice."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [B, F] -> [B, F/4]
        a = h[:, : h.shape[1] // 4]
        return a * a


def activations(ctx) -> dict:
    """The measured peak of saved activations of a small known model against the tensors it must save.

    Linear(H, F) saves its input x [B, H] (and its weight: a parameter, not counted); Square saves a view of
    the Linear's output twice: the whole [B, F] storage counts once; Linear(F/4, O) saves its input [B, F/4];
    MSE saves the output and the target [B, O] each. Counted per saved tensor instead, Square would give
    2·B·F/4 and the total would differ.
    """
    b, h, f, o = 4, 16, 32, 8
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(h, f), Square(), torch.nn.Linear(f // 4, o))
    pm = plait.parallelize(model, ctx, microbatches=1, loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(b, h), torch.randn(b, o)
    pm.train_step(x, y)
    first = pm.memory_report()
    pm.train_step(x, y, measure_memory=False)
    return {"report": first, "expected": 4 * b * (h + f + f // 4 + 2 * o), "keys": sorted(first),
            "after_unmeasured": pm.memory_report()["activations_peak"]}


OWN = ("layers.1.mlp.up_proj.weight", "layers.2.self_attn.q_proj.weight")


def rank_main() -> dict:
    with ExitStack() as contexts:
        return run_checks(checks(contexts))


def checks(contexts: ExitStack) -> list:
    """The checks, over contexts that ``contexts`` closes once they have run."""
    tp2pp2 = contexts.enter_context(plait.init(tp=2, pp=2, dp=1))
    tp2dp2 = contexts.enter_context(plait.init(tp=2, pp=1, dp=2))
    pp2dp2 = contexts.enter_context(plait.init(tp=1, pp=2, dp=2))
    tp4 = contexts.enter_context(plait.init(tp=4, pp=1, dp=1))
    dp4 = contexts.enter_context(plait.init(tp=1, pp=1, dp=4))
    # experts split over TP, each EP rank's shards sharded by ZeRO over their expert-data-parallel group
    etp = contexts.enter_context(plait.init(tp=2, pp=1, dp=2, ep=2, expert_tp=True))
    tied, moe = {"tie_embeddings": True}, {"n_experts": 4, "top_k": 2}
    return [
        *[(f"etp/tp2dp2ep2/zero{z}", lambda z=z: compare(etp, zero=z, cfg=moe)) for z in (1, 2, 3)],
        ("tp2pp2/sp", lambda: compare(tp2pp2, microbatches=4, sp=True)),
        ("tp2dp2/zero1", lambda: compare(tp2dp2, zero=1)),
        ("tp2dp2/zero0", lambda: compare(tp2dp2, zero=0)),
        ("tp2dp2/zero1/own-group", lambda: compare(tp2dp2, zero=1, own_group=OWN)),
        ("pp2dp2/tied", lambda: compare(pp2dp2, cfg=tied)),
        ("pp2dp2/tied/zero1", lambda: compare(pp2dp2, cfg=tied, zero=1)),
        ("pp2dp2/tied/zero1-allreduce", lambda: compare(pp2dp2, cfg=tied, zero=1, reduce_scatter=False)),
        ("tp4/kv-replicated", lambda: compare(tp4, cfg={"n_kv_heads": 2}, microbatches=1)),
        ("tp4/kv-replicated/sp", lambda: compare(tp4, cfg={"n_kv_heads": 1}, sp=True)),
        ("tp2pp2/bf16", lambda: compare(tp2pp2, precision="bf16", microbatches=4)),
        ("tp2dp2/bf16/zero1", lambda: compare(tp2dp2, precision="bf16", zero=1)),
        # bf16 copies of buckets reduced over dp, handed over as each completes (optim/precision.py early copies)
        ("pp2dp2/tied/bf16", lambda: compare(pp2dp2, cfg=tied, precision="bf16", microbatches=4)),
        ("tp2dp2/zero1/resume", lambda: resume(tp2dp2, zero=1)),
        ("tp2dp2/zero1/gathered", lambda: gathered(tp2dp2)),
        ("memory/activations", lambda: activations(dp4)),
    ]
