"""``plait plan``'s best layout as ``plait train`` settings: the flags to paste and the ``--config`` file."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

#: the settings always spelt out among the flags, even at plait train's defaults: the model, the layout's shape, its
#: micro-batches
ALWAYS = ("model", "tp", "pp", "dp", "microbatches")


def _folder(model_arg: str) -> Path:
    """The folder of ``--model``: the folder given, or a config.json's."""
    return Path(model_arg).parent if model_arg.endswith(".json") else Path(model_arg)


def train_gap(best, model_arg: str) -> str | None:
    """Why ``plait train`` does not run ``best`` as planned, or None: a plan-only layout, a config of a family plait
    does not train, or sequences longer than the model's context (plait train refuses a --seq-len beyond it)."""
    import json

    from plait.hf_config import FAMILY_FIELDS, model_type
    from plait.plan.config import runtime_gap

    if not best.layout.runnable:
        return f"the best layout is plan-only ({runtime_gap(best.layout)}); drop --plan-only"
    config = _folder(model_arg) / "config.json"
    if config.is_file() and (kind := model_type(json.loads(config.read_text()))) not in FAMILY_FIELDS:
        return f"--model {model_arg}: model_type {kind!r} is not one plait train builds ({', '.join(FAMILY_FIELDS)})"
    context, seq = best.model.context, best.model.seq_len
    if context is not None and seq > context and _trainable(model_arg):
        where = "max_position_embeddings in its config.json" if config.is_file() else "the preset's max_seq_len"
        return (f"--seq-len {seq} exceeds {best.model.name}'s context of {context:,} tokens ({where}), which plait "
                "train keeps to")
    return None


def _trainable(model_arg: str) -> bool:
    """Whether plait train builds ``--model`` itself: a preset of its own, a folder or its config.json."""
    from plait.train.config import PRESETS

    return model_arg in PRESETS or (_folder(model_arg) / "config.json").is_file()


def train_values(best, model_arg: str) -> dict[str, Any]:
    """``best``'s settings as ``plait train`` reads them (flat ``TrainConfig`` names): the model where plait train
    builds it (a preset of its own, a Hugging Face folder or its config.json's folder; else None), the layout as the
    runtime's ``ParallelConfig``, the global batch, the sequence length and --document-mask. ConfigError where
    plait train does not run it (``train_gap``)."""
    from plait.errors import ConfigError
    from plait.train.config import PRESETS

    if gap := train_gap(best, model_arg):
        raise ConfigError(gap)
    model = (model_arg if model_arg in PRESETS else str(_folder(model_arg))) if _trainable(model_arg) else None
    return {"model": model, **best.layout.to_parallel_config(best.training, rounds=best.rounds).to_dict(),
            "batch_size": best.training.global_batch, "seq_len": best.model.seq_len,
            **({"document_mask": True} if best.training.document_mask else {})}


def train_flags(values: dict[str, Any]) -> list[str]:
    """``plait train``'s command-line words for ``values`` (``train_values``): each setting away from plait train's
    default, and ``ALWAYS``'s always; a boolean as ``--x`` or ``--no-x``."""
    from plait.train.config import TrainConfig

    defaults = TrainConfig().to_dict()
    words: list[str] = []
    for name, value in values.items():
        if value is None or (name not in ALWAYS and value == defaults.get(name)):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [flag, str(value)]
    return words


def plan_flags(best, model_arg: str, cluster: Path | None) -> list[str] | None:
    """The words to paste into ``plait train`` for ``best`` (``train_flags``), with ``--cluster`` where the plan was
    made on a host profile, so that the run predicts with it; None where plait train does not run it
    (``train_gap``)."""
    from plait.parallel_config import ParallelConfig, field_names

    if train_gap(best, model_arg):
        return None
    values = train_values(best, model_arg)
    layout = {k: v for k, v in values.items() if k in field_names()}
    if ParallelConfig(**{**layout, "virtual_stages": None}).pipeline_schedule().virtual == values["virtual_stages"]:
        values["virtual_stages"] = None  # the schedule's own (1, or 2 for a V or interleaved schedule): no flag
    if values["rounds"] == "equal":
        values["rounds"] = None  # what --rounds left out runs
    return train_flags(values) + (["--cluster", str(cluster)] if cluster is not None else [])


def flags_line(best, model_arg: str, cluster: Path | None) -> str:
    """One line of ``plait plan``'s output: the best layout as ``plait train`` flags (``plan_flags``), what they
    leave to the user (a model folder for a planner preset; torchrun on each node across nodes), or why plait
    train does not run it."""
    words = plan_flags(best, model_arg, cluster)
    if words is None:
        return f"plait train does not run it: {train_gap(best, model_arg)}"
    line = "as plait train flags: " + shlex.join(words)
    if "--model" not in words:
        line += f" (and --model: a Hugging Face folder of {best.model.name})"
    nodes = -(-best.cluster.n_gpus // best.cluster.gpus_per_node)
    if cluster is None and nodes > 1:
        line += f"; on {nodes} nodes, under torchrun on each: torchrun ... -m plait.cli.main train FLAGS"
    return line


def write_config(path: Path, best, model_arg: str) -> None:
    """Write ``best``'s settings (``train_values``) as a ``plait train --config`` TOML file."""
    from plait.errors import ConfigError, check_output_path
    from plait.train.config import toml_text

    check_output_path("--write-config", str(path), folder=False)
    try:
        values = train_values(best, model_arg)
    except ConfigError as exc:
        raise ConfigError(f"--write-config: {exc}") from None
    size, m, dp = best.layout.microbatch_size, values["microbatches"], values["dp"]  # the label's mbN: N sequences
    header = (f"plait plan's best layout for {best.model.name}: {best.layout.short()} ({best.step_time_s:.3g} s/step "
              f"predicted on {best.cluster.n_gpus} x {best.cluster.gpu.name})\nmb{size}: micro-batches of {size} "
              f"sequence{'s' * (size != 1)}: batch-size {values['batch_size']} = dp {dp} x microbatches {m} x {size}")
    if values["model"] is None:
        header += f"\n{model_arg} is a planner preset: give plait train --model a Hugging Face folder of it"
    path.parent.mkdir(parents=True, exist_ok=True)  # as every command's output files: their folders made
    path.write_text(toml_text(values, header))
