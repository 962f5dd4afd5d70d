"""What ``--resume`` and ``--auto-resume`` find before a run starts (no process launched, no torch imported): the
checkpoint they would continue, that it holds this model, and a run already complete at it."""

from __future__ import annotations

import json
from pathlib import Path

from plait.errors import ConfigError
from plait.train.config import TrainConfig, model_config


def no_checkpoint(cfg: TrainConfig) -> ConfigError:
    """The error of --resume when --checkpoint-dir holds no complete checkpoint (naming the incomplete ones)."""
    from plait.checkpoint import incomplete_checkpoints

    passed = passed_over(incomplete_checkpoints(cfg.checkpoint_dir, None))
    return ConfigError(f"--resume: no {'complete ' if passed else ''}checkpoint in --checkpoint-dir "
                       f"{cfg.checkpoint_dir}{f' ({passed})' if passed else ''} (--auto-resume starts fresh when "
                       "there is none)")


def passed_over(folders: list[Path] | list[str]) -> str:
    """What a resume says of the checkpoints it could not take (``incomplete_checkpoints``): '' for none."""
    if not folders:
        return ""
    names = ", ".join(str(f) for f in folders)
    return (f"{names} {'has' if len(folders) == 1 else 'have'} no meta.json: not a complete checkpoint (a save or a "
            "copy that did not finish)")


def complete_message(cfg: TrainConfig, found: str | Path, step: int) -> str:
    """What --resume or --auto-resume says when the checkpoint it found, ``found`` of step ``step``, is at or past
    --steps: the run is complete, nothing to train, and how to train on."""
    flag = "--resume" if cfg.resume else "--auto-resume"
    past = f", past --steps {cfg.steps}" if step > cfg.steps else ""
    return (f"plait train: the run is already complete at step {step}{past} ({found}); nothing to train. To train "
            f"on, give a larger --steps (above {step}) with {flag}.")


def check_checkpoint_dir(cfg: TrainConfig) -> None:
    """--resume and --auto-resume continue a folder of checkpoints. Refused, saying what to give instead, where
    --checkpoint-dir is one checkpoint (the run would save its own inside it) or a Hugging Face model folder (no
    checkpoint in it: --resume could only say 'no checkpoint', --auto-resume started fresh from random weights and
    saved among the model's files)."""
    from plait.checkpoint.writer import FORMAT, META

    if not (cfg.resume or cfg.auto_resume):
        return
    flag, p = "--resume" if cfg.resume else "--auto-resume", Path(cfg.checkpoint_dir)
    try:
        one = (p / META).is_file() and json.loads((p / META).read_text()).get("format") == FORMAT
    except ValueError:  # a damaged meta.json: the reader names it
        one = True
    if one:
        raise ConfigError(f"{flag}: --checkpoint-dir {p} is one checkpoint, not a folder of them (this run would save "
                          f"its own inside it): give --checkpoint-dir {p.parent} to continue its latest, or, to go on "
                          f"from this one, copy it into a folder of its own: mkdir new && cp -r {p} new/ && "
                          f"plait train {flag} --checkpoint-dir new")
    if (p / "config.json").is_file() and not any(p.glob("step_*")):
        raise ConfigError(f"{flag}: --checkpoint-dir {p} is a Hugging Face model folder (config.json), not a folder "
                          f"of plait checkpoints: to train from its weights give --model {p}, and a --checkpoint-dir "
                          "of the run's own")


def check_resume(cfg: TrainConfig) -> tuple[Path, int] | None:
    """The checkpoint --resume or --auto-resume would continue must hold this model; --resume needs one (checked
    before any process starts). Returns that checkpoint and its step (None: a fresh start)."""
    from plait.checkpoint import CheckpointReader, find_checkpoint
    from plait.checkpoint.store import model_config as saved_model_config

    if not (cfg.resume or cfg.auto_resume):
        return None
    found = find_checkpoint(cfg.checkpoint_dir)
    if found is None:
        if cfg.resume:
            raise no_checkpoint(cfg)
        return None
    flag = "--resume" if cfg.resume else "--auto-resume"
    reader = CheckpointReader(found)
    reader.check_files(data=cfg.dry_run)
    meta = reader.meta
    # Both sides through the config class, so a field added since the save (absent there, at its default) is no
    # difference.
    saved = None if meta.get("model") is None else json.loads(json.dumps(saved_model_config(meta).to_dict()))
    now = json.loads(json.dumps(model_config(cfg).to_dict()))
    if saved is not None and saved != now:
        differ = ", ".join(f"{k} {saved.get(k)} -> {now.get(k)}" for k in sorted(set(saved) | set(now))
                           if saved.get(k) != now.get(k))
        raise ConfigError(f"{flag}: {found} holds another model than --model {cfg.model} ({differ}); resume with "
                          f"the model it was trained as (--model {meta.get('train', {}).get('model', '?')}) or give "
                          "a fresh --checkpoint-dir")
    return found, int(meta["step"])
