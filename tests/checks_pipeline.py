"""Rank-side checks: every schedule over TP x PP x DP equals one device; peaks match the simulator."""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import plait
from checks_families import family_checks
from checks_llama import expect_config_error
from checks_plan import plan_checks
from harness import rel_err, run_checks
from memory_util import LiveBytes, layer_bytes, saved_bytes
from plait.models import Llama, LlamaConfig
from plait.schedules import SCHEDULE_NAMES
from plait.sim import Costs, simulate

BATCH, SEQ = 8, 8
#: (schedule, recompute mode) run under tp2·pp2 with SP; zbv with "full" is tp2pp2sp/zbv/checkpointing
RECOMPUTE_CASES = [("1f1b", "selective"), ("interleaved-1f1b", "selective"), ("zbv", "selective"),
                   ("1f1b", "full"), ("interleaved-1f1b", "full")]


def cfg_for(**kw) -> LlamaConfig:
    base = dict(vocab_size=61, dim=32, n_layers=8, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
    base.update(kw)
    return LlamaConfig(**base)


def data(vocab: int, batch: int = BATCH, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, SEQ + 1), generator=g)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    targets[1, :2] = -100
    return inputs, targets


def single_device(cfg: LlamaConfig, inputs, targets):
    torch.manual_seed(0)
    model = Llama(cfg)
    loss = model.loss(inputs, targets)
    loss.backward()
    return float(loss), {k: p.grad.clone() for k, p in model.named_parameters()}, model


def compare(ctx, schedule: str, microbatches: int = 8, virtual: int = 1, sp: bool = False,
            partition="balanced", checkpointing: bool | str = False, batch: int = BATCH, rounds: str | None = None,
            **cfg_kw) -> dict:
    cfg = cfg_for(**cfg_kw)
    inputs, targets = data(cfg.vocab_size, batch=batch)
    ref_loss, ref_grads, ref_model = single_device(cfg, inputs, targets)
    torch.manual_seed(0)
    config = None
    if rounds is not None:  # set through ParallelConfig (plait.parallelize's keywords do not name it)
        config = replace(ctx.config, schedule=schedule, microbatches=microbatches, virtual_stages=virtual,
                         rounds=rounds)
    pm = plait.parallelize(Llama(cfg), ctx, schedule=schedule, microbatches=microbatches,
                           virtual_stages=virtual, sequence_parallel=sp, partition=partition,
                           activation_checkpointing=checkpointing, config=config)
    per = batch // ctx.dp_size
    local = slice(ctx.dp_rank * per, (ctx.dp_rank + 1) * per)
    loss = pm.train_step(inputs[local], targets[local])
    grads = pm.full_state_dict(grads=True)
    errs = {k: rel_err(grads[k], g) for k, g in ref_grads.items()}
    sim = simulate(pm.schedule, Costs())
    logits = pm.eval_step(inputs[local])
    return {
        "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
        "grad_rel_max": max(errs.values()),
        "worst": max(errs, key=errs.get),
        "peak_measured": pm.last_stats.peak_stored,
        "peak_sim": sim.peak_activations[ctx.pp_rank],
        "peak_sends": pm.last_stats.peak_sends,
        "virtual": pm.schedule.virtual,
        "logits_rel": rel_err(logits, ref_model(inputs[local]).detach()),
        "partition": pm.partition,
        "round_widths": pm.schedule.meta.get("round_widths"),
    }


class Residual(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def sequential_model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), *[Residual(16) for _ in range(6)], nn.Linear(16, 3))


def compare_sequential(ctx, schedule: str) -> dict:
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)
    ref = sequential_model()
    F.mse_loss(ref(x), y).backward()
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    pm = plait.parallelize(sequential_model(), ctx, schedule=schedule, microbatches=4, loss_fn=F.mse_loss)
    per = BATCH // ctx.dp_size
    local = slice(ctx.dp_rank * per, (ctx.dp_rank + 1) * per)
    loss = pm.train_step(x[local], y[local])
    grads = pm.full_state_dict(grads=True)
    return {"loss_rel": abs(loss - float(F.mse_loss(ref(x), y))) / float(F.mse_loss(ref(x), y)),
            "grad_rel_max": max(rel_err(grads[k], g) for k, g in ref_grads.items()),
            "worst": "", "peak_measured": pm.last_stats.peak_stored,
            "peak_sim": simulate(pm.schedule, Costs()).peak_activations[ctx.pp_rank]}


def check_trace(ctx, schedule: str, virtual: int = 1) -> dict:
    """The measured timeline holds exactly the schedule's actions, in the schedule's order, per rank."""
    cfg = cfg_for()
    inputs, targets = data(cfg.vocab_size)
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg), ctx, schedule=schedule, microbatches=8, virtual_stages=virtual)
    before = time.perf_counter()
    pm.train_step(inputs, targets, trace=True)
    after = time.perf_counter()
    stats = pm.last_stats
    # on the host's clock (what docs/planner-log.md's sharing study, entry 18, lined ranks up by): every action
    # inside the step
    clock_ok = before <= stats.started_at and all(
        before <= stats.started_at + s <= stats.started_at + e <= after for _, s, e in stats.timeline)
    report = pm.trace_report()
    order_ok = all(
        [a for r, a, _, _ in report.measured.timeline if r == rank] == pm.schedule.actions[rank]
        for rank in range(pm.schedule.num_ranks))
    starts_ok = all(e >= s >= 0 for _, _, s, e in report.measured.timeline)
    events = [e for e in report.measured.to_chrome_trace()["traceEvents"] if e.get("ph") == "X"]
    costs = report.measured.costs
    return {"order_ok": order_ok, "times_ok": starts_ok and clock_ok, "n_events": len(events),
            "n_actions": pm.schedule.num_actions, "costs_positive": min(costs.forward) > 0,
            "text": report.to_text(80)}


def check_sequence_length_change(ctx) -> dict:
    """Shapes are negotiated again when the sequence length changes between steps."""
    cfg = cfg_for(max_seq_len=16)
    torch.manual_seed(0)
    pm = plait.parallelize(Llama(cfg), ctx, schedule="1f1b", microbatches=4)
    errs, grad_errs = [], {}
    for seq in (8, 16, 12):
        g = torch.Generator().manual_seed(seq)
        tokens = torch.randint(0, cfg.vocab_size, (4, seq + 1), generator=g)
        torch.manual_seed(0)
        ref_model = Llama(cfg)
        ref = ref_model.loss(tokens[:, :-1], tokens[:, 1:])
        ref.backward()
        loss = pm.train_step(tokens[:, :-1], tokens[:, 1:])
        errs.append(abs(loss - float(ref)) / float(ref))
        grads = pm.full_state_dict(grads=True)
        for k, p in ref_model.named_parameters():
            grad_errs[k] = max(grad_errs.get(k, 0.0), rel_err(grads[k], p.grad))
    return {"loss_rel": max(errs), "grad_rel_max": max(grad_errs.values()), "worst": max(grad_errs, key=grad_errs.get),
            "peak_measured": pm.last_stats.peak_stored,
            "peak_sim": simulate(pm.schedule, Costs()).peak_activations[ctx.pp_rank]}


def compare_unequal_dp(ctx, kind: str) -> dict:
    """DP replicas holding different numbers of rows (6 and 2) still give the global-batch mean."""
    rows = [6, 2]
    lo = sum(rows[:ctx.dp_rank])
    local = slice(lo, lo + rows[ctx.dp_rank])
    if kind == "sequential":
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)
        ref = sequential_model()
        ref_loss = F.mse_loss(ref(x), y)
        pm = plait.parallelize(sequential_model(), ctx, schedule="1f1b", microbatches=2, loss_fn=F.mse_loss)
    else:
        cfg = cfg_for(n_experts=4, top_k=2) if kind == "moe" else cfg_for()
        x, y = data(cfg.vocab_size)
        torch.manual_seed(0)
        ref = Llama(cfg)
        ref_loss = ref.loss(x, y)
        torch.manual_seed(0)
        pm = plait.parallelize(Llama(cfg), ctx, schedule="1f1b", microbatches=2)
    ref_loss.backward()
    loss = pm.train_step(x[local], y[local])
    grads = pm.full_state_dict(grads=True)
    errs = {k: rel_err(grads[k], p.grad) for k, p in ref.named_parameters()}
    return {"loss_rel": abs(loss - float(ref_loss)) / float(ref_loss), "grad_rel_max": max(errs.values()),
            "worst": max(errs, key=errs.get), "peak_measured": pm.last_stats.peak_stored,
            "peak_sim": simulate(pm.schedule, Costs()).peak_activations[ctx.pp_rank]}


def compare_from_meta(ctx, schedule: str) -> dict:
    """A model built on the meta device: each rank allocates only its shards, then loads full tensors."""
    cfg = cfg_for(tie_embeddings=True)
    inputs, targets = data(cfg.vocab_size)
    ref_loss, ref_grads, ref_model = single_device(cfg, inputs, targets)
    with torch.device("meta"):
        model = Llama(cfg)
    pm = plait.parallelize(model, ctx, schedule=schedule, microbatches=8, sequence_parallel=ctx.tp_size > 1)
    pm.load_full_state_dict(ref_model.state_dict())
    loss = pm.train_step(inputs, targets)
    grads = pm.full_state_dict(grads=True)
    errs = {k: rel_err(grads[k], g) for k, g in ref_grads.items()}
    return {"loss_rel": abs(loss - ref_loss) / abs(ref_loss), "grad_rel_max": max(errs.values()),
            "worst": max(errs, key=errs.get), "peak_measured": pm.last_stats.peak_stored,
            "peak_sim": simulate(pm.schedule, Costs()).peak_activations[ctx.pp_rank],
            "local_fraction": sum(p.numel() for p in pm.parameters()) / ref_model.num_parameters(),
            "any_meta": any(p.is_meta for p in pm.parameters())}


def check_layer_activations(ctx) -> dict:
    """Bytes one decoder layer saves on a TP rank (tp2, with and without SP, MHA and GQA, none/selective)
    equal the count of docs/runtime.md; parallelize installs the recomputed core on every attention module."""
    from plait.recompute import RecomputedCore

    b, s = 2, 16
    out = {}
    for kv in (4, 2):
        cfg = cfg_for(n_layers=2, dim=64, n_kv_heads=kv, max_seq_len=s)
        for sp in (False, True):
            for mode in ("none", "selective"):
                torch.manual_seed(0)
                pm = plait.parallelize(Llama(cfg), ctx, schedule="1f1b", microbatches=2, sequence_parallel=sp,
                                       activation_checkpointing=mode)
                chunk = next(iter(pm.chunks.values()))
                layer = next(blk for name, blk in zip(chunk.names, chunk.blocks, strict=True) if "layers." in name)
                x = torch.randn(b, s // ctx.tp_size if sp else s, cfg.dim, requires_grad=True)
                got, _ = saved_bytes(layer, x, pm.parameters())
                want = layer_bytes(cfg, b, s, mode, t=ctx.tp_size, sp=sp)
                cores = [type(m.__dict__.get("core")) is RecomputedCore for m in layer.modules()
                         if hasattr(m, "core")]
                out[f"kv{kv}/sp{int(sp)}/{mode}"] = (got, want, cores)
    return out


def check_seeded_init(ctx, moe: bool = False) -> dict:
    """A model built on the meta device and initialised from a seed (plait train's way) holds, gathered, the
    weights a plain model initialised with that seed has on one device; the most bytes alive at once while
    building, sharding and initialising stay within this rank's shards plus one full tensor."""
    from plait.checkpoint.shards import init_local
    from plait.models import init_weights

    cfg = cfg_for(dim=64, n_experts=4, top_k=2) if moe else cfg_for(dim=64, tie_embeddings=True)
    with LiveBytes() as meter:
        with torch.device("meta"):
            model = Llama(cfg)
        pm = plait.parallelize(model, ctx, schedule="1f1b", microbatches=2)
        init_local(pm, seed=7)
    full = pm.full_state_dict()
    ref = init_weights(Llama(cfg), 7).state_dict()
    local = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in pm.parameters()}
    return {"keys": sorted(full) == sorted(ref), "equal": all(torch.equal(full[k], ref[k]) for k in ref),
            "peak": meter.peak, "local": sum(local.values()), "largest": max(4 * v.numel() for v in ref.values()),
            "model": sum(4 * v.numel() for v in Llama(cfg).parameters())}


def world4_checks(contexts: ExitStack) -> list:
    """The pipeline checks of the world of 4, over contexts that ``contexts`` closes once they have run."""
    checks = []
    pp4 = contexts.enter_context(plait.init(tp=1, pp=4, dp=1))
    for name in SCHEDULE_NAMES:
        virtual = 2 if name in ("interleaved-1f1b", "looped-bfs") else 1
        checks.append((f"pp4/{name}", lambda c=pp4, n=name, v=virtual: compare(c, n, virtual=v)))
    checks.append(("pp4/1f1b/tied", lambda: compare(pp4, "1f1b", tie_embeddings=True)))
    checks.append(("pp4/zbv/tied", lambda: compare(pp4, "zbv", tie_embeddings=True)))
    checks.append(("pp4/1f1b/uneven", lambda: compare(pp4, "1f1b", partition=[1, 3, 2, 2])))
    checks.append(("pp4/zb-h1/checkpointing", lambda: compare(pp4, "zb-h1", checkpointing=True)))
    checks.append(("pp4/gpipe/m4", lambda: compare(pp4, "gpipe", microbatches=4)))
    checks.append(("pp4/sequential/1f1b", lambda: compare_sequential(pp4, "1f1b")))
    checks.append(("pp4/sequential/zbv", lambda: compare_sequential(pp4, "zbv")))
    checks.append(("pp4/seq_change", lambda: check_sequence_length_change(pp4)))
    checks.append(("trace/1f1b", lambda: check_trace(pp4, "1f1b")))
    checks.append(("trace/zbv", lambda: check_trace(pp4, "zbv")))
    checks.append(("trace/zb-h1/v2", lambda: check_trace(pp4, "zb-h1", virtual=2)))
    # ZB1P, and depth-first rounds when M % P != 0: equal rounds (5, 5) and (5, 4), padded (4, 4, 2)
    checks.append(("pp4/zb-h1/v2", lambda: compare(pp4, "zb-h1", virtual=2)))
    checks.append(("pp4/interleaved-1f1b/m10", lambda: compare(pp4, "interleaved-1f1b", 10, 2, batch=10)))
    checks.append(("pp4/interleaved-1f1b/m10/padded", lambda: compare(pp4, "interleaved-1f1b", 10, 2, batch=10,
                                                                      rounds="padded")))
    checks.append(("pp4/zb-h1/v2/m9", lambda: compare(pp4, "zb-h1", 9, 2, batch=9)))
    tp2pp2 = contexts.enter_context(plait.init(tp=2, pp=2, dp=1))
    for name in ("1f1b", "interleaved-1f1b", "zbv"):
        v = 2 if name == "interleaved-1f1b" else 1
        checks.append((f"tp2pp2sp/{name}", lambda n=name, v=v: compare(tp2pp2, n, virtual=v, sp=True)))
    checks.append(("tp2pp2/zb-h1/tied", lambda: compare(tp2pp2, "zb-h1", tie_embeddings=True)))
    checks.append(("tp2pp2sp/zbv/meta", lambda: compare_from_meta(tp2pp2, "zbv")))
    checks.append(("pp4/1f1b/meta", lambda: compare_from_meta(pp4, "1f1b")))
    checks.append(("tp2pp2sp/zbv/checkpointing", lambda: compare(tp2pp2, "zbv", sp=True, checkpointing=True)))
    checks.append(("activations/tp2", lambda: check_layer_activations(tp2pp2)))
    checks.append(("init/tp2pp2", lambda: check_seeded_init(tp2pp2)))
    checks.append(("init/tp1pp1dp4", lambda: seeded_init_in(dict(tp=1, pp=1, dp=4))))
    checks.append(("init/tp2pp2ep2/moe", lambda: seeded_init_in(dict(tp=2, pp=2, dp=1, ep=2), moe=True)))
    checks.append(("init/tp1pp1dp4ep4/moe", lambda: seeded_init_in(dict(tp=1, pp=1, dp=4, ep=4), moe=True)))
    for name, mode in RECOMPUTE_CASES:  # recomputation under TP+SP equals one device without it
        v = 2 if name == "interleaved-1f1b" else 1
        checks.append((f"tp2pp2sp/{name}/{mode}", lambda n=name, v=v, m=mode: compare(
            tp2pp2, n, microbatches=4, virtual=v, sp=True, checkpointing=m)))
    pp2dp2 = contexts.enter_context(plait.init(tp=1, pp=2, dp=2))
    checks.append(("pp2dp2/interleaved-1f1b", lambda: compare(pp2dp2, "interleaved-1f1b", microbatches=4,
                                                             virtual=2)))
    checks.append(("pp2dp2/dualpipev", lambda: compare(pp2dp2, "dualpipev", microbatches=4)))
    checks.append(("pp2dp2/sequential/gpipe", lambda: compare_sequential(pp2dp2, "gpipe")))
    for kind in ("sequential", "llama"):
        checks.append((f"pp2dp2/unequal/{kind}", lambda k=kind: compare_unequal_dp(pp2dp2, k)))
    pp2dp2ep2 = contexts.enter_context(plait.init(tp=1, pp=2, dp=2, ep=2))
    checks.append(("pp2dp2ep2/unequal/moe", lambda: compare_unequal_dp(pp2dp2ep2, "moe")))
    return checks + plan_checks()  # every value the planner emits at this world size runs


def world8_checks(contexts: ExitStack) -> list:
    ctx = contexts.enter_context(plait.init(tp=2, pp=2, dp=2))
    checks = []
    for name in ("zbv", "1f1b", "interleaved-1f1b", "dualpipev"):
        v = 2 if name == "interleaved-1f1b" else 1
        checks.append((f"tp2pp2dp2/{name}", lambda n=name, v=v: compare(ctx, n, microbatches=4, virtual=v,
                                                                       sp=n == "zbv", tie_embeddings=True)))
    return checks


def seeded_init_in(layout: dict, moe: bool = False) -> dict:
    with plait.init(**layout) as ctx:
        return check_seeded_init(ctx, moe=moe)


def bad_checks(world: int) -> list:
    def run(schedule="1f1b", microbatches=8, batch=BATCH, n_layers=8, virtual=1):
        with plait.init(tp=1, pp=4, dp=world // 4) as ctx:
            cfg = cfg_for(n_layers=n_layers)
            pm = plait.parallelize(Llama(cfg), ctx, schedule=schedule, microbatches=microbatches,
                                   virtual_stages=virtual)
            inputs, targets = data(cfg.vocab_size, batch=batch)
            pm.train_step(inputs, targets)

    return [
        ("bad/batch_not_divisible", lambda: expect_config_error(lambda: run(batch=6))),
        ("bad/too_few_layers", lambda: expect_config_error(lambda: run(n_layers=6, schedule="zbv"))),
        ("bad/unknown_schedule", lambda: expect_config_error(lambda: run(schedule="2f2b"))),
        ("bad/microbatches_zero", lambda: expect_config_error(lambda: run(microbatches=0))),
    ]


def rank_main(families: str | None = None, zero: str | None = None) -> dict:
    """``families``: a folder of Hugging Face models (checks_families.make_folders) checked in the world of 4;
    ``zero``: a scratch folder for the ZeRO checks (checks_zero) run in the world of 8."""
    world = int(os.environ["WORLD_SIZE"])
    results = {}
    with ExitStack() as contexts:
        checks = world4_checks(contexts) if world == 4 else world8_checks(contexts)
        if world == 4 and families is not None:
            checks += family_checks(Path(families), contexts)
        if world == 8 and zero is not None:
            import checks_zero

            checks += checks_zero.checks(Path(zero), contexts)
        for name, fn in checks:
            results.update(run_checks([(name, fn)]))
    if world == 4:
        results.update(run_checks(bad_checks(world)))
    return results
