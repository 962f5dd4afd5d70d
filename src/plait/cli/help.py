"""Readable ``--help``: each option's value named as a user types it (``INT``, ``FILE``, ``NAME|DIR``), not as
typer names its Python type (``<int>``, ``<list[str]>``); arguments as their metavar alone (``SRC...``)."""

from __future__ import annotations

import typing
from typing import Any

import typer
from typer.core import TyperCommand

# the value of these options (by parameter name, or (command, name) where commands differ), where its type
# alone (str, Path) would not say it
NAMED: dict[Any, str] = {
    "model": "NAME|DIR", ("plan", "model"): "NAME|FILE", ("topo", "model"): "NAME", ("serve", "model"): "DIR",
    ("generate", "model"): "DIR", "data": "[WEIGHT:]PATH",
    "checkpoint_dir": "DIR", "metrics": "FILE", "tensorboard": "DIR", "wandb": "PROJECT", "cluster": "FILE",
    ("train", "cluster"): "FILE|none", "config": "FILE", "out": "DIR", ("calibrate", "out"): "FILE",
    "prompt": "TEXT", "host": "ADDRESS", "api_key": "KEY", "chat_template": "FILE|TEXT",
    "chat_template_kwargs": "JSON", "tokenizer": "bytes|DIR",
    "eos": "ID|TOKEN", "text_field": "FIELD", "messages_field": "FIELD", "compare": "NAME,NAME,...",
    "png": "FILE", "trace": "FILE", "csv": "FILE", "from_csv": "FILE", "write_config": "FILE", "file": "FILE",
    "checkpoint": "CHECKPOINT", ("export", "out"): "OUT",
}


def metavar(command: str, param: Any) -> str | None:
    """What a user types for ``param`` (an option or argument) of ``command``; None for a flag (no value)."""
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return None
    name = param.name or ""
    if (command, name) in NAMED or name in NAMED:
        return NAMED.get((command, name), NAMED.get(name))
    if param.param_type_name == "argument":
        return name.upper()
    desc = getattr(param, "type_descriptor", None)  # recent typer: the annotation (its own click has no types)
    if desc is not None:
        kind = typing.get_args(desc.annotation)[0] if desc.is_list else desc.annotation
        return "PATH" if desc.is_path else {int: "INT", float: "FLOAT"}.get(kind, "NAME")
    kind = getattr(param.type, "name", "")  # click's type: "integer", "float range", "path", "text"
    return {"integer": "INT", "integer range": "INT", "float": "FLOAT", "float range": "FLOAT",
            "path": "PATH"}.get(kind, "NAME")


class ReadableCommand(TyperCommand):
    """A typer command whose options and arguments carry ``metavar``'s names (unless given their own)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        for param in self.params:
            if param.metavar is None:
                param.metavar = metavar(self.name or "", param)

    def format_options(self, ctx: Any, formatter: Any) -> None:
        """Arguments as ``SRC...  help`` (typer would add ``<list[str]>``), options as typer writes them."""
        args, opts = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                args.append((f"{param.metavar}{'...' if param.nargs != 1 else ''}", record[1]))
            else:
                opts.append(record)
        for title, rows in (("Arguments", args), ("Options", opts)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def readable(app: typer.Typer) -> None:
    """Make every command of ``app`` (sub-groups' too) a ``ReadableCommand``, unless it names another class."""
    for info in app.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = ReadableCommand
    for group in app.registered_groups:
        if group.typer_instance is not None:
            readable(group.typer_instance)
