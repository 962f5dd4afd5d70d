"""Rank-side checks in the shared world of 4: ZeRO-3 (parameters sharded over data parallelism).

5 clipped AdamW steps against one device under dp4, tp2·dp2 + SP, dp4 with selective and full recomputation,
tp2·dp2·ep2 MoE (experts sharded over their expert-data group), bf16, and pp2·dp2 (each stage sharded over its
DP pair: 1f1b, gpipe with full recomputation and tied embeddings, bf16 with selective recomputation; two chunks a
rank under interleaved-1f1b, in bf16 with selective recomputation, and looped-bfs with full recomputation and
tied embeddings); the bytes held between steps and the gathered working set of a step; exact resume; ZeRO-3
checkpoints loaded under other layouts (tp2·pp2, pp1 ZeRO-1 and back, interleaved too); ``plait verify``'s rank
side under ZeRO-3; the ConfigErrors."""

from __future__ import annotations

import io
from contextlib import ExitStack
from pathlib import Path

import torch

import plait
from checks_optim import BATCH, EPS, LR, STEPS, WD, batch, build, cfg_for, compare, measure, reference, train
from harness import rel_err, run_checks
from plait.checkpoint import load_checkpoint, save_checkpoint
from plait.models import Llama
from plait.optim import ParallelOptimizer
from plait.plan import Layout, Model
from plait.plan.memory import zero3_working


def held(ctx, **kw) -> dict:
    """Bytes of one ZeRO-3 run against the bucket geometry: parameters held between steps (float32 shards),
    gradients after the step (reduced shards), the gathered working set (two neighbouring blocks of a chunk at
    most: ``pair_max``)."""
    out, pm, _ = measure(ctx, zero=3, **kw)
    cfg = cfg_for(**kw.get("cfg", {}))
    layout = Layout(tp=ctx.tp_size, pp=ctx.pp_size, dp=ctx.dp_size, zero=3, schedule=pm.schedule.name,
                    virtual_stages=pm.schedule.virtual)
    planned = zero3_working(Model.from_llama_config(cfg), layout, kw.get("precision", "fp32"), ctx.pp_rank)
    sh = pm.param_shards
    unit = [sum(s.nbytes for s in need) for need in sh.needs]
    pairs = [unit[i] + unit[i + 1] for i in range(len(unit)) if i + 1 < sh.end[i]] or unit  # inside a chunk
    return {**out, "shard_elements": sum(s.b.shard for s in sh.sharded.values()),
            "n_param_buckets": len(sh.sharded), "gathered_now": sh.gathered_bytes(),
            "pair_max": max(pairs), "unit_max": max(unit),
            "pp_rank": ctx.pp_rank,
            "planned_gathered": planned,  # the planner's (plan.memory.zero3_working) for this rank
            "model_params": sum(p.numel() for p in Llama(cfg_for(**kw.get("cfg", {}))).parameters())}


def grads_at_launch(ctx) -> dict:
    """Full (unsharded) gradient bytes alive whenever a bucket's reduce-scatter starts, over 2 steps of 2
    micro-batches: the launching bucket's own gradients only, never another block's, an earlier micro-batch's
    or a full input still in flight."""
    pm, opt = build(ctx, {}, zero=3)
    (reducer,) = pm.reducers.values()
    launch, seen = reducer._launch, []

    def spy(b) -> None:
        others = sum(p.grad.nbytes for q in reducer.buckets if q is not b for p in q.params if p.grad is not None)
        others += sum(q.buffer.nbytes for q in reducer.buckets if q.buffer is not None)
        seen.append((others, sum(p.grad.nbytes for p in b.params if p.grad is not None), 4 * b.numel))
        launch(b)

    reducer._launch = spy
    train(ctx, pm, opt, range(2), cfg_for().vocab_size)
    return {"launches": len(seen), "expected": 2 * pm.microbatches * len(reducer.buckets),
            "others_max": max(o for o, _, _ in seen), "own_complete": all(own == n for _, own, n in seen)}


class Spare(torch.nn.Module):
    """A linear layer beside a trainable parameter its forward never uses (ZeRO-3 shards it all the same)."""

    def __init__(self, h: int):
        super().__init__()
        self.lin = torch.nn.Linear(h, h)
        self.spare = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def unused_parameter(ctx) -> dict:
    """A parameter no forward uses: its block's reduce-scatter waits for the step's end (on every rank alike), its
    gradient is zeros and every other gradient equals ZeRO-0's (all-reduced) on the same world, 2 micro-batches."""
    grads = {}
    for zero in (0, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(Spare(8), torch.nn.Linear(8, 4))
        pm = plait.parallelize(model, ctx, microbatches=2, zero=zero, loss_fn=torch.nn.functional.mse_loss)
        g = torch.Generator().manual_seed(ctx.dp_rank)
        pm.train_step(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
        grads[zero] = pm.full_state_dict(grads=True)
    return {"spare_zero": bool(torch.all(grads[3]["0.spare"] == 0)),
            "rel_max": max(rel_err(grads[3][k], v) for k, v in grads[0].items())}


def resume_exact(ctx) -> dict:
    """3 steps, save the model (full state) and each rank's optimizer state, rebuild, load, 2 more steps: the
    same bits as 5 uninterrupted steps; and within rounding of one device."""
    vocab = cfg_for().vocab_size
    pm, opt = build(ctx, {}, zero=3, sp=True)
    train(ctx, pm, opt, range(STEPS), vocab)
    straight = pm.full_state_dict()
    pm, opt = build(ctx, {}, zero=3, sp=True)
    train(ctx, pm, opt, range(3), vocab)
    buf = io.BytesIO()
    torch.save({"model": pm.full_state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    pm2, opt2 = build(ctx, {}, zero=3, sp=True)
    pm2.load_full_state_dict(saved["model"])
    opt2.load_state_dict(saved["optim"])
    train(ctx, pm2, opt2, range(3, STEPS), vocab)
    state = pm2.full_state_dict()
    ref_state = reference()[0]
    return {"identical": all(torch.equal(state[k], v) for k, v in straight.items()), "steps": opt2.steps,
            "param_rel_max": max(rel_err(state[k], v) for k, v in ref_state.items())}


def across_layouts(root: Path, a, b, zero_a: int = 3, zero_b: int = 0, mb_a: int = 2, mb_b: int = 4,
                   name: str = "zero3", schedule_a: str = "1f1b", schedule_b: str = "1f1b") -> dict:
    """3 steps under layout ``a`` (``zero_a``, ``schedule_a``), save; load under layout ``b`` (``zero_b``,
    ``schedule_b``) and run the last 2 steps: equal to one device; the first run's full state equals what the
    other layout loaded."""
    vocab = cfg_for().vocab_size
    pm, opt = build(a, {}, zero=zero_a, microbatches=mb_a, schedule=schedule_a)
    train(a, pm, opt, range(3), vocab)
    saved = save_checkpoint(pm, opt, root / name, 3)
    before = pm.full_state_dict()
    pm2, opt2 = build(b, {}, zero=zero_b, microbatches=mb_b, schedule=schedule_b)
    load_checkpoint(pm2, opt2, saved)
    opt2.steps = 3
    loaded = pm2.full_state_dict()
    train(b, pm2, opt2, range(3, STEPS), vocab)
    ref_state = reference()[0]
    state = pm2.full_state_dict()
    return {"loaded_equal": all(torch.equal(loaded[k], v) for k, v in before.items()),
            "param_rel_max": max(rel_err(state[k], v) for k, v in ref_state.items())}


def round_trip(root: Path, ctx) -> dict:
    """A ZeRO-3 checkpoint saved and loaded under the same layout: the model and the moments come back
    bit for bit (load_checkpoint writes each rank's shard)."""
    vocab = cfg_for().vocab_size
    pm, opt = build(ctx, {}, zero=3, precision="bf16")
    train(ctx, pm, opt, range(2), vocab)
    path = save_checkpoint(pm, opt, root / "round-trip", 2)
    pm2, opt2 = build(ctx, {}, zero=3, precision="bf16")
    load_checkpoint(pm2, opt2, path)
    same_model = all(torch.equal(pm2.full_state_dict()[k], v) for k, v in pm.full_state_dict().items())
    a, b = opt.gathered_state(), opt2.gathered_state()
    names = dict(pm2.named_model_parameters())
    same_optim = all(torch.equal(b[names[n]][k], v) for n, p in pm.named_model_parameters() for k, v in a[p].items()
                     if torch.is_tensor(v) and v.dim() > 0)
    return {"same_model": same_model, "same_optim": same_optim}


def plain_optimizers(ctx) -> dict:
    """``torch.optim.SGD`` (momentum) and ``AdamW`` over ``pm.parameters()`` (the float32 shards, their reduced
    gradient shards as ``.grad``), 3 steps under ZeRO-3: one device's losses and weights."""
    cfg, per = cfg_for(), BATCH // ctx.dp_size
    local = slice(ctx.dp_rank * per, (ctx.dp_rank + 1) * per)
    out = {}
    for name, make in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9)),
                       ("adamw", lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WD, eps=EPS))):
        torch.manual_seed(0)
        model = Llama(cfg)
        torch.manual_seed(0)
        pm = plait.parallelize(Llama(cfg), ctx, microbatches=2, zero=3)
        ref_opt, opt = make(model.parameters()), make(pm.parameters())
        start = {k: v.clone() for k, v in model.state_dict().items()}
        ref_losses, losses = [], []
        for k in range(3):
            inputs, targets = batch(cfg.vocab_size, k)
            ref_opt.zero_grad()
            loss = model.loss(inputs, targets)
            loss.backward()
            ref_opt.step()
            ref_losses.append(float(loss.detach()))
            opt.zero_grad()
            losses.append(pm.train_step(inputs[local], targets[local]))
            opt.step()
        state = pm.full_state_dict()
        out[name] = {"loss_rel_max": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
                     "param_rel_max": max(rel_err(state[k], v) for k, v in model.state_dict().items()),
                     "moved": min(rel_err(state[k], v) for k, v in start.items()) > 0}
    try:  # the shards have no names: a named optimizer is refused (it would step the empty whole parameters)
        torch.optim.AdamW(pm.named_parameters(), lr=LR)
        out["named"] = "no error"
    except plait.ConfigError as exc:
        out["named"] = str(exc)
    return out


def refusals(pp2, dp4) -> dict:
    """ConfigErrors, before any collective: ZeRO-3 under a schedule with a split backward (zero-bubble, one chunk
    a rank or two); an optimizer's zero unlike the model's."""
    out = {}
    for name, fn in (("zbv", lambda: plait.parallelize(Llama(cfg_for()), pp2, zero=3, microbatches=4, schedule="zbv")),
                     ("zb-h1", lambda: plait.parallelize(Llama(cfg_for()), pp2, zero=3, schedule="zb-h1")),
                     ("opt3", lambda: ParallelOptimizer(plait.parallelize(Llama(cfg_for()), dp4), zero=3)),
                     ("opt1", lambda: ParallelOptimizer(plait.parallelize(Llama(cfg_for()), dp4, zero=3), zero=1))):
        try:
            fn()
            out[name] = "no error"
        except plait.ConfigError as exc:
            out[name] = str(exc)
    return out


def verify_rank(ctx) -> dict:
    """``plait verify --tp 2 --dp 2 --pp 1 --zero 3``'s rank side (gradients gathered from their shards)."""
    from plait.verify import VerifyConfig, _rank_main

    del ctx
    cfg = VerifyConfig(parallel=plait.ParallelConfig(tp=2, pp=1, dp=2, microbatches=2, zero=3), n_layers=2)
    res = _rank_main(cfg)
    return {"ok": None if res is None else res.ok, "worst": None if res is None else max(g.rel for g in res.grads)}


def rank_main(root: str) -> dict:
    """``root``: a scratch folder shared by the ranks (checkpoints)."""
    with ExitStack() as contexts:
        return run_checks(checks(Path(root), contexts))


def checks(root: Path, contexts: ExitStack) -> list:
    """The checks, over contexts that ``contexts`` closes once they have run."""
    dp4 = contexts.enter_context(plait.init(tp=1, pp=1, dp=4))
    tp2dp2 = contexts.enter_context(plait.init(tp=2, pp=1, dp=2))
    moe = contexts.enter_context(plait.init(tp=2, pp=1, dp=2, ep=2))
    tp2pp2 = contexts.enter_context(plait.init(tp=2, pp=2, dp=1))
    pp2dp2 = contexts.enter_context(plait.init(tp=1, pp=2, dp=2))
    return [
        ("dp4", lambda: held(dp4)),
        ("tp2dp2/sp", lambda: held(tp2dp2, sp=True)),
        ("dp4/grads-at-launch", lambda: grads_at_launch(dp4)),
        ("dp4/unused-parameter", lambda: unused_parameter(dp4)),
        ("dp4/selective", lambda: compare(dp4, zero=3, recompute="selective")),
        ("dp4/full/tied", lambda: compare(dp4, zero=3, recompute="full", cfg={"tie_embeddings": True})),
        ("tp2dp2ep2/moe", lambda: compare(moe, zero=3, cfg={"n_experts": 4, "top_k": 2})),
        ("dp4/bf16", lambda: compare(dp4, zero=3, precision="bf16")),
        ("tp2dp2/sp/resume", lambda: resume_exact(tp2dp2)),
        ("dp4/checkpoint", lambda: round_trip(root, dp4)),
        ("tp2dp2->tp2pp2", lambda: across_layouts(root, tp2dp2, tp2pp2)),
        ("pp2dp2", lambda: held(pp2dp2, microbatches=4)),
        ("pp2dp2/gpipe/full/tied", lambda: held(pp2dp2, microbatches=4, schedule="gpipe", recompute="full",
                                                cfg={"tie_embeddings": True})),
        ("pp2dp2/bf16/selective", lambda: compare(pp2dp2, zero=3, microbatches=4, precision="bf16",
                                                  recompute="selective")),
        ("pp2dp2/interleaved", lambda: held(pp2dp2, microbatches=4, schedule="interleaved-1f1b")),
        ("pp2dp2/looped-bfs/full/tied", lambda: held(pp2dp2, microbatches=4, schedule="looped-bfs", recompute="full",
                                                     cfg={"tie_embeddings": True})),
        ("pp2dp2/interleaved/bf16/selective", lambda: compare(pp2dp2, zero=3, microbatches=4, precision="bf16",
                                                              recompute="selective", schedule="interleaved-1f1b")),
        ("pp2dp2/interleaved->dp4/zero1", lambda: across_layouts(root, pp2dp2, dp4, zero_b=1, mb_a=4, mb_b=2,
                                                                 name="il-z3", schedule_a="interleaved-1f1b")),
        ("dp4/zero1->pp2dp2/interleaved", lambda: across_layouts(root, dp4, pp2dp2, zero_a=1, zero_b=3, mb_b=4,
                                                                 name="il-z1", schedule_b="interleaved-1f1b")),
        ("pp2dp2->dp4/zero1", lambda: across_layouts(root, pp2dp2, dp4, zero_b=1, mb_a=4, mb_b=2, name="pp2z3")),
        ("dp4/zero1->pp2dp2", lambda: across_layouts(root, dp4, pp2dp2, zero_a=1, zero_b=3, name="dp4z1")),
        ("tp2dp2/plain-optimizers", lambda: plain_optimizers(tp2dp2)),
        ("refusals", lambda: refusals(tp2pp2, dp4)),
        ("verify", lambda: verify_rank(dp4)),
    ]
