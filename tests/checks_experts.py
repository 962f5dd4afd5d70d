"""Rank-side checks: mixture-of-experts Llama under EP x TP x PP x DP equals the single-device MoE model."""

from __future__ import annotations

import copy
import shutil
import tempfile
from contextlib import ExitStack

import torch
import torch.distributed as dist

import plait
from checks_llama import expect_config_error
from harness import rel_err, run_checks
from plait.models import Llama, LlamaConfig
from plait.models.moe import MoE, pop_aux_losses, route

BATCH, SEQ = 8, 8


def moe_cfg(**kw) -> LlamaConfig:
    base = dict(vocab_size=61, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=SEQ,
                n_experts=4, top_k=2, aux_loss_coef=0.1)
    base.update(kw)
    return LlamaConfig(**base)


def data(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    targets[1, :2] = -100
    return inputs, targets


def build(cfg: LlamaConfig, zero_router: bool) -> Llama:
    torch.manual_seed(0)
    model = Llama(cfg)
    if zero_router:  # all router logits equal: every token picks experts 0..k-1, the rest stay empty
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, MoE):
                    m.gate.weight.zero_()
    return model


def expert_load(model: Llama, inputs: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """Assignments per expert and dropped ones, per MoE layer of the single-device model."""
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
             for m in model.modules() if isinstance(m, MoE)]
    with torch.no_grad():
        model(inputs)
    for h in hooks:
        h.remove()
    pop_aux_losses(model)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    counts, dropped = [], []
    for m, x in zip(moes, seen, strict=True):
        r = route(m.gate(x), m.top_k, m.capacity_factor, 0.0)
        counts.append(torch.bincount(r.expert[r.keep], minlength=m.n_experts).tolist())
        dropped.append(int((~r.keep).sum()))
    return counts, dropped


def single_device(cfg: LlamaConfig, inputs, targets, zero_router: bool, precision: str = "fp32"):
    """Loss, auxiliary loss and gradients of one device (bf16: of a bf16 copy, as fp32), and the fp32 model."""
    model = build(cfg, zero_router)
    run = copy.deepcopy(model).to(torch.bfloat16) if precision == "bf16" else model
    logits = run(inputs)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
    aux = pop_aux_losses(run) / inputs.shape[0]
    loss = ce + aux
    loss.backward()
    grads = {k: p.grad.float() for k, p in run.named_parameters()}
    return loss.item(), aux.item(), grads, model


def norm_and_checkpoint(pm, ref_grads: dict, ref_model: Llama) -> dict:
    """The optimizer's global gradient norm, and a checkpoint written and read back, against one device."""
    from plait.checkpoint import CheckpointReader, load_checkpoint, save_checkpoint
    from plait.optim import ParallelOptimizer

    ref_norm = float(sum(g.double().pow(2).sum() for g in ref_grads.values()).sqrt())
    norm = ParallelOptimizer(pm, lr=1e-3).grad_norm()
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    path = save_checkpoint(pm, None, box[0], 1)
    saved = CheckpointReader(path).full_state_dict()  # a shard written twice would change a shape
    with torch.no_grad():
        for p in pm.parameters():
            p.zero_()
    load_checkpoint(pm, None, path)
    reloaded = pm.full_state_dict()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(box[0], ignore_errors=True)
    ref = ref_model.state_dict()
    return {"norm_rel": abs(norm - ref_norm) / ref_norm,
            "ckpt_rel": max(rel_err(saved[k], v) if k in saved else float("inf") for k, v in ref.items()),
            "reload_rel": max(rel_err(reloaded[k], v) for k, v in ref.items())}


def compare(ctx, schedule: str = "1f1b", microbatches: int = 2, virtual: int = 1, sp: bool = False,
            zero_router: bool = False, extras: bool = False, recompute: str = "none", precision: str = "fp32",
            **cfg_kw) -> dict:
    cfg = moe_cfg(**cfg_kw)
    inputs, targets = data(cfg.vocab_size)
    ref_loss, ref_aux, ref_grads, ref_model = single_device(cfg, inputs, targets, zero_router, precision)
    pm = plait.parallelize(build(cfg, zero_router), ctx, schedule=schedule, microbatches=microbatches,
                           virtual_stages=virtual, sequence_parallel=sp, activation_checkpointing=recompute,
                           precision=precision)
    per = BATCH // ctx.dp_size
    local = slice(ctx.dp_rank * per, (ctx.dp_rank + 1) * per)
    loss = pm.train_step(inputs[local], targets[local])
    grads = pm.full_state_dict(grads=True)
    errs = {k: rel_err(grads[k], g) for k, g in ref_grads.items()}
    weights = pm.full_state_dict()
    more = norm_and_checkpoint(pm, ref_grads, ref_model) if extras else {}
    counts, dropped = expert_load(ref_model, inputs)
    seen = pm.last_expert_load
    return more | {
        "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
        "aux_rel": abs(pm.last_aux_loss - ref_aux) / abs(ref_aux),
        "aux": pm.last_aux_loss,
        "grad_rel_max": max(errs.values()),
        "worst": max(errs, key=errs.get),
        "keys_match": sorted(grads) == sorted(ref_grads),
        "weights_rel": max(rel_err(weights[k], v) for k, v in ref_model.state_dict().items()),
        "expert_grad_norm": float(sum(g.norm() for k, g in ref_grads.items() if ".experts." in k)),
        "load": [sum(c) for c in zip(*counts, strict=True)],
        "load_counts": (seen.counts, seen.dropped) if seen is not None else None,
        "ref_counts": (counts, dropped),
        "local_experts": sorted({int(n.split(".experts.")[1].split(".")[0])
                                 for n, _ in pm.named_parameters() if ".experts." in n}),
        "n_experts": cfg.n_experts,
        "expert_rows": {int(p.shape[0]) for n, p in pm.named_parameters()
                        if ".experts." in n and n.endswith("gate_proj.weight")},
        "ep_rank": ctx.ep_rank,
        "ep": ctx.ep_size,
    }


def equality_checks(contexts: ExitStack) -> list:
    """Checks over contexts that ``contexts`` closes once they have run."""
    checks = []
    dp4ep2 = contexts.enter_context(plait.init(tp=1, pp=1, dp=4, ep=2))
    checks.append(("dp4ep2/1f1b", lambda: compare(dp4ep2)))
    dp4ep4 = contexts.enter_context(plait.init(tp=1, pp=1, dp=4, ep=4))
    checks.append(("dp4ep4/1f1b", lambda: compare(dp4ep4)))
    checks.append(("dp4ep4/top1_all_to_one", lambda: compare(dp4ep4, top_k=1, zero_router=True)))
    checks.append(("dp4ep4/empty_experts", lambda: compare(dp4ep4, n_experts=8, zero_router=True)))
    checks.append(("dp4ep4/capacity", lambda: compare(dp4ep4, capacity_factor=0.5)))
    tp2dp2ep4 = contexts.enter_context(plait.init(tp=2, pp=1, dp=2, ep=4))
    checks.append(("tp2dp2ep4/1f1b", lambda: compare(tp2dp2ep4)))
    checks.append(("tp2dp2ep4/sp", lambda: compare(tp2dp2ep4, sp=True)))
    tp2dp2ep2 = contexts.enter_context(plait.init(tp=2, pp=1, dp=2, ep=2))
    checks.append(("tp2dp2ep2/sp/moe_every2", lambda: compare(tp2dp2ep2, sp=True, moe_every=2)))
    tp2dp2 = contexts.enter_context(plait.init(tp=2, pp=1, dp=2, ep=1))
    checks.append(("tp2dp2ep1/1f1b", lambda: compare(tp2dp2)))
    tp2pp2ep2 = contexts.enter_context(plait.init(tp=2, pp=2, dp=1, ep=2))
    checks.append(("tp2pp2ep2/1f1b", lambda: compare(tp2pp2ep2, microbatches=4)))
    checks.append(("tp2pp2ep2/zbv/sp", lambda: compare(tp2pp2ep2, "zbv", microbatches=4, sp=True)))
    checks.append(("tp2pp2ep2/interleaved", lambda: compare(tp2pp2ep2, "interleaved-1f1b", microbatches=4,
                                                            virtual=2)))
    for mode in ("selective", "full"):  # recomputation with experts (EP all-to-alls run again when full)
        checks.append((f"tp2pp2ep2/zbv/sp/{mode}", lambda m=mode: compare(tp2pp2ep2, "zbv", microbatches=4, sp=True,
                                                                          recompute=m)))
    pp2dp2ep2 = contexts.enter_context(plait.init(tp=1, pp=2, dp=2, ep=2))
    for name in ("gpipe", "zb-h1", "dualpipev", "looped-bfs"):
        v = 2 if name == "looped-bfs" else 1
        checks.append((f"pp2dp2ep2/{name}", lambda n=name, v=v: compare(pp2dp2ep2, n, microbatches=4,
                                                                       virtual=v)))
    checks.append(("pp2dp2ep2/zb-h1/selective", lambda: compare(pp2dp2ep2, "zb-h1", microbatches=4,
                                                                recompute="selective")))
    checks.append(("pp2dp2ep2/all_to_one", lambda: compare(pp2dp2ep2, "1f1b", top_k=1, zero_router=True)))
    # bf16 against one device's bf16. top_k = n_experts sends every token to every expert, so rounding cannot
    # flip a routing choice: with top-2 of 4 a token whose 2nd and 3rd probabilities nearly tie may pick
    # another expert under a layout's different bf16 rounding, which changes those experts' gradients by
    # far more than rounding does.
    checks.append(("bf16/dp4ep2/every_expert", lambda: compare(dp4ep2, precision="bf16", top_k=4)))
    checks.append(("bf16/tp2dp2ep2/sp/every_expert", lambda: compare(tp2dp2ep2, sp=True, precision="bf16",
                                                                     top_k=4)))
    return checks + expert_tp_checks(contexts)


def expert_tp_checks(contexts: ExitStack) -> list:
    """Experts tensor-parallel inside (plait.init(..., expert_tp=True)) composed with EP, PP, DP and SP."""
    checks = []
    # EP across DP, expert-DP groups of one
    ep2 = contexts.enter_context(plait.init(tp=2, pp=1, dp=2, ep=2, expert_tp=True))
    checks.append(("etp/tp2dp2ep2/1f1b", lambda: compare(ep2, extras=True)))
    checks.append(("etp/tp2dp2ep2/sp/top1", lambda: compare(ep2, sp=True, top_k=1)))
    checks.append(("etp/bf16/tp2dp2ep2/every_expert", lambda: compare(ep2, precision="bf16", top_k=4)))
    # every expert on every rank, reduced over DP
    ep1 = contexts.enter_context(plait.init(tp=2, pp=1, dp=2, ep=1, expert_tp=True))
    checks.append(("etp/tp2dp2ep1/sp", lambda: compare(ep1, sp=True, extras=True)))
    pp2 = contexts.enter_context(plait.init(tp=2, pp=2, dp=1, ep=1, expert_tp=True))
    checks.append(("etp/tp2pp2/1f1b", lambda: compare(pp2, microbatches=4, extras=True)))
    checks.append(("etp/tp2pp2/zbv/sp", lambda: compare(pp2, "zbv", microbatches=4, sp=True)))
    checks.append(("etp/tp2pp2/zb-h1/capacity", lambda: compare(pp2, "zb-h1", microbatches=4,
                                                                capacity_factor=0.5)))
    return checks


def bad_checks() -> list:
    def run(ep: int, **kw):
        with plait.init(tp=1, pp=1, dp=4, ep=ep) as ctx:
            plait.parallelize(Llama(moe_cfg(**kw)), ctx)

    def still_works() -> dict:
        with plait.init(tp=1, pp=1, dp=4, ep=2) as ctx:
            return compare(ctx)

    return [
        ("bad/experts_not_divisible", lambda: expect_config_error(lambda: run(4, n_experts=6))),
        ("bad/ep_dense_model", lambda: expect_config_error(lambda: run(2, n_experts=1, top_k=1))),
        ("bad/ep_not_dividing_plane", lambda: expect_config_error(lambda: plait.init(tp=2, pp=2, dp=1, ep=4))),
        ("bad/top_k", lambda: expect_config_error(lambda: moe_cfg(top_k=5))),
        ("bad/expert_tp_ep_not_dividing_dp", lambda: expect_config_error(
            lambda: plait.init(tp=2, pp=1, dp=2, ep=4, expert_tp=True))),
        ("after_bad/still_works", still_works),
    ]


def rank_main() -> dict:
    with ExitStack() as contexts:
        results = run_checks(equality_checks(contexts))
    results.update(run_checks(bad_checks()))
    return results
