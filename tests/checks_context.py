"""Rank-side checks of context parallelism (4 ranks): the mesh, and loss, every gradient and the eval logits of
a Llama under cp (with TP+SP, PP schedules, DP, EP, recomputation, bf16, both K/V exchanges) against one device."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import plait
from harness import rel_err, run_checks
from plait.models import Llama, LlamaConfig

BATCH, SEQ = 4, 16


def check_mesh(tp: int, cp: int, pp: int, dp: int) -> dict:
    """This rank's coordinates against rank = ((pp·dp + dp_rank)·cp + cp_rank)·tp + tp_rank, and the members of
    its CP and dp×cp groups (every member with this rank's other coordinates)."""
    with plait.init(tp=tp, pp=pp, dp=dp, cp=cp) as ctx:
        coords = (ctx.tp_rank, ctx.cp_rank, ctx.dp_rank, ctx.pp_rank)
        formula = ((ctx.pp_rank * dp + ctx.dp_rank) * cp + ctx.cp_rank) * tp + ctx.tp_rank
        want_cp = [ctx.global_rank(cp_rank=c) for c in range(cp)]
        want_dcp = [ctx.global_rank(dp_rank=d, cp_rank=c) for d in range(dp) for c in range(cp)]
        cp_members = dist.get_process_group_ranks(ctx.cp_group) if ctx.cp_group is not None else [ctx.rank]
        return {"rank": ctx.rank, "formula": formula, "coords": coords,
                "cp_group_ok": cp_members == want_cp, "dp_cp_group_ok":
                    dist.get_process_group_ranks(ctx.dp_cp_group) == want_dcp if dp * cp > 1 else True,
                "pp_peer_ok": all(ctx.pp_peer(p) == ctx.global_rank(pp_rank=p) for p in range(pp))}


MESHES = {"tp1cp4": (1, 4, 1, 1), "tp2cp2": (2, 2, 1, 1), "cp2dp2": (1, 2, 1, 2), "cp2pp2": (1, 2, 2, 1),
          "tp2dp2": (2, 1, 1, 2)}


def model_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=61, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
    base.update(kw)
    return LlamaConfig(**base)


def batch(cfg: LlamaConfig):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    targets[0, 5:9] = -100  # ignored targets spread unevenly over the CP ranks' chunks
    return inputs, targets


def reference(cfg: LlamaConfig, inputs, targets):
    """Loss, gradients and logits of the single-device model (checks_pipeline's seeded reference)."""
    from checks_pipeline import single_device

    loss, grads, model = single_device(cfg, inputs, targets)
    with torch.no_grad():
        logits = model(inputs)
    return loss, grads, logits


def compare(model_kw: dict | None = None, **layout) -> dict:
    """One train_step and one eval_step under ``layout`` (ParallelConfig fields) against one device."""
    cfg = model_config(**(model_kw or {}))
    inputs, targets = batch(cfg)
    return against(reference(cfg, inputs, targets), cfg, inputs, targets, layout)


def against(ref: tuple, cfg: LlamaConfig, inputs, targets, layout: dict, **parallelize_kw) -> dict:
    """One train_step and one eval_step of ``Llama(cfg)`` (seeded 0, ``plait.parallelize(..., **parallelize_kw)``)
    under ``layout`` on ``inputs``/``targets`` [BATCH, S] (each DP replica its rows), against ``ref``: the loss,
    gradients and logits a single device should give."""
    ref_loss, ref_grads, ref_logits = ref
    with plait.init(config=plait.ParallelConfig(**layout)) as ctx:
        torch.manual_seed(0)
        pm = plait.parallelize(Llama(cfg), ctx, **parallelize_kw)
        per = BATCH // ctx.dp_size
        local = slice(ctx.dp_rank * per, (ctx.dp_rank + 1) * per)
        loss = pm.train_step(inputs[local], targets[local], measure_memory=True)
        grads = pm.full_state_dict(grads=True)
        errs = {k: rel_err(grads[k], g) for k, g in ref_grads.items()}
        logits = pm.eval_step(inputs[local])
    return {"loss_rel": abs(loss - ref_loss) / abs(ref_loss), "grad_rel_max": max(errs.values()),
            "worst_grad": max(errs, key=errs.get), "n_grads": len(errs),
            "logits_rel": rel_err(logits, ref_logits[local]), "activations": pm.activations_peak,
            "targets": pm.last_loss_targets}


ALLGATHER, RING = dict(cp_comm="allgather"), dict(cp_comm="ring")
MOE = dict(n_experts=4, top_k=2, moe_every=2)
FEATURES = dict(sliding_window=5, qkv_bias=True, qk_norm=True,  # a window, Qwen2's biases, Qwen3's norms
                layer_types=("sliding_attention", "full_attention") * 2)  # the window on layers 0 and 2 (Qwen)
#: name -> (ParallelConfig fields, model config fields): all on 4 ranks
CASES: dict[str, tuple[dict, dict]] = {}
for _mode, _comm in (("allgather", ALLGATHER), ("ring", RING)):
    CASES |= {
        f"cp4/{_mode}": (dict(cp=4, dp=1, microbatches=2, **_comm), {}),
        f"cp2tp2sp/{_mode}": (dict(cp=2, tp=2, dp=1, sequence_parallel=True, **_comm), {}),
        f"cp2dp2/selective/{_mode}": (dict(cp=2, dp=2, recompute="selective", **_comm), {}),
        f"cp2pp2/1f1b/{_mode}": (dict(cp=2, pp=2, dp=1, microbatches=4, **_comm), {}),
        f"cp2ep2/{_mode}": (dict(cp=2, dp=2, ep=2, **_comm), MOE),
        f"cp4/features/{_mode}": (dict(cp=4, dp=1, **_comm), FEATURES),
    }
CASES |= {
    "cp2pp2/interleaved": (dict(cp=2, pp=2, dp=1, schedule="interleaved-1f1b", microbatches=4), {}),
    "cp2pp2/zbv": (dict(cp=2, pp=2, dp=1, schedule="zbv", microbatches=4, **RING), {}),
    "cp2dp2/full": (dict(cp=2, dp=2, recompute="full"), {}),
    "cp2dp2/zero3": (dict(cp=2, dp=2, zero=3, cp_comm="ring"), {}),
    "cp2tp2/tied": (dict(cp=2, tp=2, dp=1), dict(tie_embeddings=True)),
    "cp2ep2tp2/expert_tp": (dict(cp=2, tp=2, dp=1, ep=2, expert_tp=True), MOE),
}


#: KV heads of the 4 query heads in the saved-bytes checks: grouped 2:1 (the default), multi-head, one shared
ACTIVATION_KV_HEADS = (2, 4, 1)


def activations(cp: int, comm: str, seq: int = 64, kv_heads: int = 2, precision: str = "fp32") -> int:
    """Peak bytes saved for backward on this rank with one row of ``seq`` tokens per CP group (dp = 4/cp)."""
    cfg = model_config(max_seq_len=seq, n_kv_heads=kv_heads)
    with plait.init(config=plait.ParallelConfig(cp=cp, dp=4 // cp, cp_comm=comm, precision=precision)) as ctx:
        torch.manual_seed(0)
        pm = plait.parallelize(Llama(cfg), ctx)
        tokens = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(ctx.dp_rank))
        pm.train_step(tokens[:, :-1], tokens[:, 1:], measure_memory=True)
        return int(pm.activations_peak or 0)


def zero(level: int, comm: str) -> dict:
    """5 clipped AdamW steps with a ZeRO optimizer over cp2·dp2 against one device (checks_optim)."""
    import checks_optim

    with plait.init(config=plait.ParallelConfig(cp=2, dp=2, cp_comm=comm)) as ctx:
        return checks_optim.compare(ctx, zero=level)


def config_error(fn) -> str:
    try:
        fn()
    except plait.ConfigError as exc:
        return f"ConfigError: {exc}"
    return "no error"


def bad_seq_len() -> None:
    with plait.init(cp=2, dp=2) as ctx:
        pm = plait.parallelize(Llama(model_config()), ctx)
        x = torch.zeros(2, 6, dtype=torch.long)  # 6 tokens do not split into 2·cp = 4 chunks
        pm.train_step(x, x)


def bad_loss_fn() -> None:
    with plait.init(cp=2, dp=2) as ctx:
        plait.parallelize(torch.nn.Sequential(torch.nn.Linear(4, 4)), ctx, loss_fn=torch.nn.functional.mse_loss)


def bad_capacity() -> None:
    with plait.init(cp=2, dp=2) as ctx:
        plait.parallelize(Llama(model_config(**MOE, capacity_factor=1.0)), ctx)


def checkpoints(root: Path) -> dict:
    """plait train under cp2·dp2 (ring, ZeRO-1) against one device; its checkpoint loaded under tp2·dp2; an
    exact resume under cp2·dp2 (all-gather, ZeRO-1); that run's step-3 checkpoint resumed under cp4 (ring, the
    ZeRO-1 shards now over cp4 instead of cp2·dp2)."""
    import shutil

    import checks_train as ct
    from plait.checkpoint import CheckpointReader, find_checkpoint, load_checkpoint
    from plait.data.stream import open_data
    from plait.train import TrainConfig
    from plait.train.config import model_config as train_model_config
    from plait.train.loop import build

    cfg = ct.small_cfg(root, "cp-a", tp=1, pp=1, dp=2, cp=2, cp_comm="ring", zero=1, microbatches=1)
    res = ct.train(cfg)
    ref = ct.reference_losses(cfg, ct.STEPS)
    got = [res.losses[s] for s in range(1, ct.STEPS + 1)]
    ckpt = find_checkpoint(root / "cp-a")
    saved = CheckpointReader(ckpt).full_state_dict()
    with plait.init(2, 1, 2) as ctx:
        run = build(TrainConfig.from_dict({**cfg.to_dict(), "tp": 2, "cp": 1}), ctx)
        load_checkpoint(run.pm, run.opt, ckpt)
        full = run.pm.full_state_dict()
        plain = Llama(train_model_config(cfg))
        plain.load_state_dict(saved)
        x, _ = open_data([], "tiny", 256, 32, 2, 0, 0.3).batch(0)
        tp2_logits_rel = rel_err(run.pm.eval_step(x), plain(x).detach())
    resume = ct.check_resume(root, "_cp", tp=1, pp=1, dp=2, cp=2, zero=1, microbatches=1)
    if dist.get_rank() == 0:
        shutil.copytree(root / "full_cp" / "step_00000003", root / "cp4" / "step_00000003")
    dist.barrier()
    cp4 = ct.train(ct.small_cfg(root, "cp4", steps=6, resume=True, tp=1, pp=1, dp=1, cp=4, cp_comm="ring", zero=1,
                                microbatches=1))
    return {"cp4_resumed": [cp4.losses[s] for s in (4, 5, 6)],
            "rel": max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)), "got": got, "ref": ref,
            "tp2_weights_rel": max(rel_err(full[k], v) for k, v in saved.items()),
            "tp2_logits_rel": tp2_logits_rel, **resume}


def bad_generate() -> None:
    with plait.init(cp=2, dp=2) as ctx:
        plait.generate(plait.parallelize(Llama(model_config()), ctx), [1, 2, 3], max_new_tokens=2)


def rank_main(root: str) -> dict:
    checks = [(f"mesh/{name}", lambda s=sizes: check_mesh(*s)) for name, sizes in MESHES.items()]
    checks += [("train/checkpoints", lambda: checkpoints(Path(root)))]
    checks += [(f"equal/{name}", lambda lay=lay, mk=mk: compare(mk, **lay)) for name, (lay, mk) in CASES.items()]
    checks += [(f"bf16/{comm}", lambda c=comm: compare(None, cp=2, dp=2, precision="bf16", cp_comm=c))
               for comm in ("allgather", "ring")]
    checks += [(f"zero{level}/{comm}", lambda lv=level, c=comm: zero(lv, c)) for level, comm in ((1, "allgather"),
                                                                                              (2, "ring"))]
    checks += [(f"activations/cp{cp}/{comm}", lambda n=cp, c=comm: activations(n, c))
               for comm in ("allgather", "ring") for cp in (1, 2, 4)]
    checks += [(f"activations/cp{cp}/{comm}/kv{kv}", lambda n=cp, c=comm, h=kv: activations(n, c, kv_heads=h))
               for comm in ("allgather", "ring") for cp in (2, 4) for kv in ACTIVATION_KV_HEADS if kv != 2]
    checks += [(f"activations/cp{cp}/{comm}/bf16", lambda n=cp, c=comm: activations(n, c, precision="bf16"))
               for comm, cps in (("allgather", (1, 2, 4)), ("ring", (2, 4))) for cp in cps]
    checks += [(f"bad/{fn.__name__}", lambda fn=fn: config_error(fn))
               for fn in (bad_seq_len, bad_loss_fn, bad_capacity, bad_generate)]
    return run_checks(checks)
