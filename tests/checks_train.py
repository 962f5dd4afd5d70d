"""Rank-side checks of training, checkpoints, Hugging Face slice loading and generation (world of 4)."""

from __future__ import annotations

import io
import json
import math
import shutil
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

import plait
from checks_experts import expert_load
from harness import rel_err, run_checks
from plait.checkpoint import CheckpointReader, find_checkpoint, load_checkpoint
from plait.checkpoint.shards import load_local
from plait.data.stream import open_data
from plait.models import Llama, init_weights
from plait.optim import lr_at
from plait.train import TrainConfig
from plait.train.loop import NonFiniteLoss, build, train, train_one
from plait.train.report import Reporter

STEPS = 4


def small_cfg(root: Path, name: str, **kw) -> TrainConfig:
    base = dict(tp=2, pp=2, dp=1, microbatches=2, seq_len=32, batch_size=4, steps=STEPS, lr=3e-3, warmup=2,
                clip=1.0, max_data_mb=0.3, eval_every=0, sample_tokens=0, trace_every=0,
                checkpoint_dir=str(root / name))
    base.update(kw)
    return TrainConfig.from_dict(base)


def reference_losses(cfg: TrainConfig, steps: int, model: torch.nn.Module | None = None) -> list[float]:
    """The same run on one device in plain torch: AdamW, warm-up + cosine LR, global-norm clip. Inside a launch
    (a default process group) rank 0 runs it and sends the losses to the others, which would each run the same;
    every rank leaves it with the torch seed set to ``cfg.seed``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return _reference(cfg, steps, model)
    box = [None]
    if dist.get_rank() == 0:
        with torch.random.fork_rng():
            box = [_reference(cfg, steps, model)]
    dist.broadcast_object_list(box, src=0)
    torch.manual_seed(cfg.seed)
    return box[0]


def _reference(cfg: TrainConfig, steps: int, model: torch.nn.Module | None) -> list[float]:
    torch.manual_seed(cfg.seed)
    from plait.train.config import model_config

    model = model if model is not None else init_weights(Llama(model_config(cfg)), cfg.seed)  # plait train's init
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    data = open_data(cfg.data, cfg.model, model_config(cfg).vocab_size, cfg.seq_len, cfg.batch_size, cfg.seed,
                     cfg.max_data_mb)
    out = []
    for step in range(steps):
        x, y = data.batch(step)
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.lr, cfg.warmup, cfg.steps)
        opt.step()
        out.append(loss.item())
    return out


def check_equals_single(root: Path) -> dict:
    cfg = small_cfg(root, "a")
    res = train(cfg)
    ref = reference_losses(cfg, STEPS)
    got = [res.losses[s] for s in range(1, STEPS + 1)]
    return {"got": got, "ref": ref, "rel": max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)),
            "checkpoint": res.checkpoint}


def check_moe(root: Path) -> dict:
    """MoE with expert parallelism (pp2 x dp2, ep2) trains like one device; its checkpoint holds every expert; its
    metrics rows and progress lines carry the routing (step 1's as the initial model routes batch 0 on one device)."""
    cfg = small_cfg(root, "moe", tp=1, pp=2, dp=2, experts=4, top_k=2, ep=2, metrics=str(root / "moe.jsonl"))
    log = io.StringIO()
    res = train(cfg, reporter=Reporter(cfg, dist.get_rank(), Console(file=log, width=200)))
    ref = reference_losses(cfg, STEPS)
    got = [res.losses[s] for s in range(1, STEPS + 1)]
    reader = CheckpointReader(find_checkpoint(root / "moe"))
    plain = Llama(plait.train.config.model_config(cfg))
    plain.load_state_dict(reader.full_state_dict())  # strict: all 4 experts of every layer present
    x, _ = open_data([], "tiny", 256, 32, 4, 0, 0.3).batch(0)
    counts, _ = expert_load(init_weights(Llama(plait.train.config.model_config(cfg)), cfg.seed), x)
    box = [log.getvalue()]
    dist.broadcast_object_list(box, src=0)  # rank 0 reports
    rows = [json.loads(line) for line in (root / "moe.jsonl").read_text().splitlines()]
    with plait.init(1, 2, 2, ep=2) as ctx:
        pm = build(cfg, ctx).pm
        load_checkpoint(pm, None, find_checkpoint(root / "moe"))
        return {"rel": max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)),
                "logits_rel": rel_err(pm.eval_step(x), plain(x).detach()), "rows": rows, "log": box[0],
                "ref_imbalance": {str(i): max(c) * len(c) / sum(c) for i, c in enumerate(counts)}}


def check_family(root: Path) -> dict:
    """plait train from a Qwen2 folder (q/k/v biases) under tp2·pp2 with SP equals one device; the checkpoint
    exports as a qwen2 folder holding the trained weights."""
    import json

    from plait.checkpoint import export_pretrained
    from plait.models import Qwen2, Qwen2Config

    folder, exported = root / "qwen2", root / "qwen2-export"
    if dist.get_rank() == 0:
        torch.manual_seed(4)
        model = Qwen2(Qwen2Config(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.1)
        model.save_pretrained(folder)
    dist.barrier()
    cfg = small_cfg(root, "qwen2-run", model=str(folder), steps=2, sequence_parallel=True, recompute="selective")
    res = train(cfg)
    ref = reference_losses(cfg, 2, plait.models.from_pretrained(folder))
    got = [res.losses[s] for s in (1, 2)]
    if dist.get_rank() == 0:
        export_pretrained(res.checkpoint, exported)
    dist.barrier()
    trained = CheckpointReader(find_checkpoint(root / "qwen2-run")).full_state_dict()
    back = plait.models.from_pretrained(exported)
    state = back.state_dict()
    return {"rel": max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)), "got": got, "ref": ref,
            "model_type": json.loads((exported / "config.json").read_text())["model_type"],
            "exported_rel": max(rel_err(state[k], v) for k, v in trained.items()), "family": type(back).__name__}


def check_resume(root: Path, tag: str = "", **kw) -> dict:
    full = train(small_cfg(root, f"full{tag}", steps=6, checkpoint_every=3, **kw))
    if dist.get_rank() == 0:  # as if the run had been killed after its step-3 checkpoint
        (root / f"part{tag}").mkdir()
        shutil.copytree(root / f"full{tag}" / "step_00000003", root / f"part{tag}" / "step_00000003")
    dist.barrier()
    resumed = train(small_cfg(root, f"part{tag}", steps=6, resume=True, **kw))
    return {"full": [full.losses[s] for s in (4, 5, 6)], "resumed": [resumed.losses[s] for s in (4, 5, 6)],
            "started": min(resumed.losses), "losses": [full.losses[s] for s in range(1, 7)],
            "gathered": [row["params_gathered_peak"] for row in full.memory]}  # ZeRO-3's per-block gathers


def check_zero3(root: Path) -> dict:
    """plait train --zero 3 (tp2·dp2): the losses of one device, and a resume continues exactly."""
    out = check_resume(root, "_zero3", tp=2, pp=1, dp=2, zero=3)
    ref = reference_losses(small_cfg(root, "unused", steps=6), 6)
    return {**out, "ref": ref, "rel": max(abs(a - b) / abs(b) for a, b in zip(out["losses"], ref, strict=True))}


def check_auto_resume(root: Path) -> dict:
    """--auto-resume on an empty folder starts fresh (and saves); on that populated folder it continues from the
    latest complete checkpoint, exactly; an unfinished save (a temp folder) beside it is passed over."""
    fresh = train(small_cfg(root, "auto", checkpoint_every=2, keep=2, auto_resume=True))
    if dist.get_rank() == 0:  # as if killed after step 2's save and while writing step 4's
        shutil.rmtree(root / "auto" / "step_00000004")
        (root / "auto" / "latest").write_text("step_00000004\n")  # names a folder that is gone
        (root / "auto" / ".step_00000004.tmp").mkdir()
    dist.barrier()
    kept = sorted(p.name for p in (root / "auto").glob("step_*"))
    again = train(small_cfg(root, "auto", checkpoint_every=2, keep=2, auto_resume=True))
    return {"fresh_started": min(fresh.losses), "kept": kept, "started": min(again.losses),
            "fresh": [fresh.losses[s] for s in (3, 4)], "resumed": [again.losses[s] for s in (3, 4)]}


def check_minutes(root: Path) -> dict:
    """--checkpoint-every-minutes: a save at every step once the interval is below a step's time (every rank the
    same steps); --keep 0 keeps them all; each saving step's blocked time is recorded."""
    res = train(small_cfg(root, "minutes", steps=3, checkpoint_every_minutes=1e-6, keep=0))
    saved = sorted(p.name for p in (root / "minutes").glob("step_*"))
    return {"saved": saved, "blocked": len(res.checkpoint_blocked_s)}


def check_async_save(root: Path) -> dict:
    """A background save holds the state of its step (training goes on meanwhile) and writes the same bytes as a
    save in the loop."""
    from plait.checkpoint import AsyncCheckpointer, save_checkpoint

    cfg = small_cfg(root, "async")
    with plait.init(config=cfg.parallel) as ctx:
        run = build(cfg, ctx)
        for step in range(2):
            train_one(run, step, False)
        save_checkpoint(run.pm, run.opt, root / "sync", 2)
        saver = AsyncCheckpointer()
        saver.save(run.pm, run.opt, root / "async", 2)
        train_one(run, 2, False)  # changes weights and optimizer state while the write may still run
        saver.wait()
        dist.barrier()
    a, b = root / "sync" / "step_00000002", root / "async" / "step_00000002"
    names = sorted(p.name for p in a.iterdir())
    return {"names": names, "same": names == sorted(p.name for p in b.iterdir())
            and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)}


def _continue(cfg: TrainConfig, ckpt: Path, tp: int, pp: int) -> tuple[list[float], dict]:
    """Load ``ckpt`` under the layout tp·pp, check weights, then train two more steps."""
    with plait.init(tp, pp, 1) as ctx:
        run = build(cfg, ctx)
        load_checkpoint(run.pm, run.opt, ckpt)
        run.opt.steps = STEPS
        full = run.pm.full_state_dict()
        losses = [train_one(run, step, False)[0] for step in (STEPS, STEPS + 1)]
        return losses, full


def check_reshard(root: Path) -> dict:
    ckpt = find_checkpoint(root / "a")
    base = small_cfg(root, "a", steps=STEPS + 2)
    ref_losses, ref_full = _continue(base, ckpt, 2, 2)
    out = {"ref_losses": ref_losses}
    for name, (tp, pp) in {"tp1pp4": (1, 4), "tp4pp1": (4, 1)}.items():
        losses, full = _continue(TrainConfig.from_dict({**base.to_dict(), "tp": tp, "pp": pp}), ckpt, tp, pp)
        out[name] = {"losses": losses, "weights_rel": max(rel_err(full[k], v) for k, v in ref_full.items())}
    plain = Llama(plait.train.config.model_config(base))
    plain.load_state_dict(CheckpointReader(ckpt).full_state_dict())  # strict: every key present
    x, _ = open_data([], "tiny", 256, 32, 4, 0, 0.3).batch(0)
    with plait.init(2, 2, 1) as ctx:
        pm2 = build(base, ctx).pm
        load_checkpoint(pm2, None, ckpt)
        out["one_device_logits_rel"] = rel_err(plain(x), pm2.eval_step(x))
    return out


def check_hf_slices(root: Path) -> dict:
    """Each rank reads only its own slices of a Hugging Face folder and gets the same weights."""
    from plait.models.hf import HFWeights

    torch.manual_seed(3)
    cfg = plait.train.config.model_config(small_cfg(root, "x"))
    model = Llama(cfg)
    folder = root / "hf"
    if dist.get_rank() == 0:
        model.save_pretrained(folder)
    dist.barrier()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(99)
    weights, asked = HFWeights(folder), []

    def read(key, dim, start, stop):
        asked.append((key, dim, start, stop))
        return weights.read(key, dim, start, stop)

    with plait.init(2, 2, 1) as ctx:
        pm = plait.parallelize(Llama(cfg), ctx, microbatches=2)
        load_local(pm, read)
        full = pm.full_state_dict()
        local_keys = len(list(pm.named_parameters()))
    sharded = [a for a in asked if a[1] is not None]
    widest = max((stop - start) / weights.shape(key)[dim] for key, dim, start, stop in sharded)
    return {"rel": max(rel_err(full[k], v) for k, v in ref.items()), "sharded_reads": len(sharded),
            "widest_fraction": widest, "keys_read": len(asked), "local_keys": local_keys}


def check_generate(root: Path) -> dict:
    """Greedy and top-k sampled tokens under three layouts and on one device, from a checkpoint and an HF folder."""
    from plait.generation.job import load_model

    texts = ["def ", "import sys\nclass "]
    out = {}
    for source in (str(find_checkpoint(root / "a")), str(root / "hf")):
        for name, (tp, pp) in {"tp2pp2": (2, 2), "tp1pp4": (1, 4), "tp4pp1": (4, 1), "single": (1, 1)}.items():
            with ExitStack() as contexts:
                ctx = contexts.enter_context(plait.init(tp, pp, 1)) if tp * pp > 1 else None
                model, tok, _ = load_model(source, ctx=ctx)  # single: a plain Llama, no process group
                prompts = [tok.encode(t) for t in texts]  # ids in, ids out: 12 new tokens whatever bytes they are
                out[f"{Path(source).name}/{name}"] = [
                    plait.generate(model, prompts, max_new_tokens=12),
                    plait.generate(model, prompts, max_new_tokens=12, temperature=0.9, top_k=8, seed=5)]
                out[f"{Path(source).name}/{name}/too_long"] = _too_long(model, tok)
    return out


def _too_long(model, tok) -> str | None:
    """The error of a prompt + max_new_tokens one past the context (None if nothing was raised)."""
    from plait.generation.decode import context_length

    try:
        plait.generate(model, "def ", max_new_tokens=context_length(model) - 3, tokenizer=tok)
    except plait.ConfigError as exc:
        return str(exc)
    return None


def check_nonfinite(root: Path) -> dict:
    out = {}
    for policy in ("stop", "skip"):
        with plait.init(2, 2, 1) as ctx:
            run = build(small_cfg(root, f"nan-{policy}", on_nonfinite=policy), ctx)
            with torch.no_grad():
                for p in run.pm.parameters():
                    p.fill_(float("nan"))
            try:
                loss, norm = train_one(run, 0, False)
                out[policy] = {"raised": None, "loss_finite": math.isfinite(loss), "norm": norm}
            except NonFiniteLoss as exc:
                out[policy] = {"raised": str(exc)}
    return out


def rank_main(root: str) -> dict:
    root = Path(root)
    return run_checks([
        ("train/equals_single", lambda: check_equals_single(root)),
        ("ckpt/reshard", lambda: check_reshard(root)),
        ("ckpt/resume", lambda: check_resume(root)),
        ("ckpt/auto_resume", lambda: check_auto_resume(root)),
        ("ckpt/async_equals_sync", lambda: check_async_save(root)),
        ("ckpt/every_minutes", lambda: check_minutes(root)),
        ("train/moe_ep2", lambda: check_moe(root)),
        ("ckpt/resume_zero1", lambda: check_resume(root, "_zero1", tp=1, pp=2, dp=2, zero=1)),
        ("ckpt/resume_zero2_bf16", lambda: check_resume(root, "_zero2", tp=1, pp=2, dp=2, zero=2, precision="bf16")),
        ("ckpt/resume_zero3", lambda: check_zero3(root)),
        ("hf/slices", lambda: check_hf_slices(root)),
        ("generate/layouts", lambda: check_generate(root)),
        ("train/nonfinite", lambda: check_nonfinite(root)),
        ("train/family_qwen2", lambda: check_family(root)),
    ])
