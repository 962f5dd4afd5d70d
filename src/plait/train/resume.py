"""Resuming a run from its checkpoint: loading it, and what of the run changed settings alter."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from plait.optim.schedule import lr_at
from plait.parallel_config import ParallelConfig
from plait.train.config import TrainConfig
from plait.train.restart import no_checkpoint
from plait.words import mesh

if TYPE_CHECKING:
    from plait.train.loop import Run


def resume(run: Run) -> None:
    """Load the latest complete checkpoint of --checkpoint-dir (rank 0 chooses it, every rank loads the same);
    with --auto-resume and none there, leave the run at its fresh start. A checkpoint at or past --steps is not
    loaded: the run is complete, ``run.start`` its step."""
    import torch.distributed as dist

    from plait.checkpoint import CheckpointReader, find_checkpoint, incomplete_checkpoints, load_checkpoint
    from plait.distributed.collectives import collective

    box: list = [None, 0, []]  # the checkpoint's folder and step, the newer folders passed over
    if run.ctx.rank == 0:
        found = find_checkpoint(run.cfg.checkpoint_dir)
        box[2] = [str(f) for f in incomplete_checkpoints(run.cfg.checkpoint_dir, found)]
        if found is not None:
            box[:2] = [str(found), int(CheckpointReader(found).meta["step"])]
    if run.ctx.world_size > 1:
        collective("broadcast of rank 0's checkpoint to resume from", None,
                   lambda: dist.broadcast_object_list(box, src=0))
    path, step, run.passed_over = box
    if path is None:
        if run.cfg.resume:
            raise no_checkpoint(run.cfg)
        return
    if step >= run.cfg.steps:
        run.start, run.resumed_from = step, path
        return
    meta = load_checkpoint(run.pm, run.opt, path)
    run.start, run.resumed_from = int(meta["step"]), path
    run.data.resume_at(run.start, meta, same_data(meta, run.cfg))
    run.resume_note, run.resharded_from = continuing(meta, run.cfg, run.ctx.config)


def continuing(meta: dict, cfg: TrainConfig, layout: ParallelConfig) -> tuple[str | None, str | None]:
    """What a run of ``cfg`` under ``layout`` (resolved) says of the checkpoint it resumes (its ``meta.json``): the
    note on the settings changed since it was saved (``resume_note``; None: none changed) and the layout it was
    saved under where that places the tensors otherwise (``resharded_from``; None: alike)."""
    saved = meta.get("train", {})  # its --data named from the directory it ran in: compared by same_data
    updates = (meta.get("optimizer") or {}).get("steps")  # updates made (a skipped step makes none)
    note = resume_note({**saved, "data": cfg.data} if same_data(meta, cfg) else saved, cfg,
                       int(meta["step"] if updates is None else updates))
    return note, resharded_from(meta, layout)


def data_paths(entries: list[str]) -> list[str]:
    """The --data entries with absolute paths (``WEIGHT:/abs/path``): what a checkpoint keeps of its datasets, the
    same whichever directory a run starts in."""
    from plait.data.stream import parse_entry

    return [f"{weight:g}:{Path(path).resolve()}" for weight, path in map(parse_entry, entries)]


def same_data(meta: dict, cfg: TrainConfig) -> bool:
    """Whether ``cfg`` reads the datasets the run of a checkpoint (its ``meta.json``) read: by their absolute paths
    (``data_paths``), so one folder named from another directory is the same data and one relative path from
    another directory is not; a checkpoint saved without them compares the entries as given."""
    paths = (meta.get("data") or {}).get("paths")
    if paths is None:
        return meta.get("train", {}).get("data", cfg.data) == cfg.data
    return paths == data_paths(cfg.data)


#: the layout options that place a checkpoint's tensors (and their optimizer state) on the ranks
SHARDING = ("tp", "cp", "pp", "dp", "ep", "zero")


def resharded_from(meta: dict, now: ParallelConfig) -> str | None:
    """``saved_layout`` of a checkpoint (its ``meta.json``) that places the tensors otherwise than ``now`` (a
    resolved layout) does; None where it places them alike."""
    saved = _sharding(meta)
    return None if all(saved[k] == getattr(now, k) for k in SHARDING) else saved_layout(meta)


def saved_layout(meta: dict) -> str:
    """The layout a checkpoint (its ``meta.json``) was saved under, e.g. ``tp 1 x pp 1 x dp 2, ZeRO-1``."""
    tp, cp, pp, dp, ep, zero = _sharding(meta).values()
    return f"{mesh(tp, pp, dp, cp)}{f', ep {ep}' if ep > 1 else ''}{f', ZeRO-{zero}' if zero else ''}"


def _sharding(meta: dict) -> dict:
    """The SHARDING options of a checkpoint's run, in SHARDING's order (the defaults where it kept none)."""
    saved = {**{k: 1 for k in SHARDING}, "zero": 0, **meta.get("train", {}), **meta.get("layout", {})}
    return {k: saved[k] for k in SHARDING}


#: the settings a resumed run continues from its checkpoint, each with what of the run it sets: the batches
#: (plait.data.stream: the step's samples over windows of --seq-len, per --seed and --data), the learning rates
#: (the schedule) or the updates
CONTINUED = {"data": "batches", "seq_len": "batches", "batch_size": "batches", "seed": "batches",
             "lr": "learning rates", "warmup": "learning rates", "steps": "learning rates",
             "weight_decay": "updates", "clip": "updates", "precision": "updates", "document_mask": "updates"}


def resume_note(saved: dict, cfg: TrainConfig, updates: int) -> str | None:
    """The header's line (rich markup) on a run resumed under ``cfg`` from a checkpoint of a run with settings
    ``saved`` (``updates`` updates made): the CONTINUED settings changed, and what of the run they make differ from
    an uninterrupted run of ``cfg``'s settings (a warning) or that nothing does; None where none changed."""
    changes = changed_settings(saved, cfg)
    if not changes:
        return None
    effects = changed_effects(saved, cfg, updates)
    if effects:
        return (f"[yellow]note: {', '.join(changes)} since that checkpoint was saved: this run's "
                f"{' and '.join(effects)} differ from an uninterrupted run's of these settings (the checkpoint's "
                "settings continue it exactly)[/]")
    return f"{', '.join(changes)} since that checkpoint was saved: the run goes on as an uninterrupted run of " \
           "these settings would"


def changed_settings(saved: dict, cfg: TrainConfig) -> list[str]:
    """``--flag saved -> now`` for each CONTINUED setting that differs from the run that saved ``saved``."""
    now = cfg.to_dict()
    return [f"--{k.replace('_', '-')} {_shown(saved[k])} -> {_shown(now[k])}" for k in _changed(saved, now)]


def changed_effects(saved: dict, cfg: TrainConfig, updates: int) -> list[str]:
    """What of a run resumed under ``cfg`` from a checkpoint of a run with settings ``saved`` (``updates``
    updates made) differs from an uninterrupted run of ``cfg``'s settings, of "batches", "learning rates" and
    "updates": the learning rates only when the schedule gives one of those updates another rate (raising
    --steps during the warm-up changes none)."""
    now = cfg.to_dict()
    changed = set(_changed(saved, now))
    schedule = ("lr", "warmup", "steps")
    if changed & set(schedule):
        old = [saved.get(k, now[k]) for k in schedule]
        if all(lr_at(k, *old) == lr_at(k, cfg.lr, cfg.warmup, cfg.steps) for k in range(updates)):
            changed -= set(schedule)
    return [e for e in dict.fromkeys(CONTINUED.values()) if any(CONTINUED[k] == e for k in changed)]


def _changed(saved: dict, now: dict) -> list[str]:
    """The CONTINUED settings of ``saved`` that differ in ``now``, in CONTINUED's order."""
    return [k for k in CONTINUED if k in saved and saved[k] != now[k]]


def _shown(value) -> str:
    return " ".join(value) or "(the standard library)" if isinstance(value, list) else str(value)
