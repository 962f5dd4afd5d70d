"""Command-line options generated from dataclass fields: one ``--flag`` per field, its help the field's docstring.

``plait train``, ``verify``, ``generate`` and ``serve`` take their layout options from ``ParallelConfig`` this
way (and ``train`` its other options from ``TrainConfig``; ``plan``, ``topo`` and ``simulate`` theirs from the
options dataclasses beside them), so a new field is a new option everywhere, with its documentation, and no
command restates a default. Only typer's public API is used: a command is a
function whose signature (``__signature__``) lists ``typer.Option`` defaults.
"""

from __future__ import annotations

import functools
import inspect
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, fields
from typing import Any

import typer

from plait.parallel_config import field_docs


def dataclass_options(cls: type, defaults: Any = None, *, only: Iterable[str] | None = None,
                      exclude: Iterable[str] = (), flags: Mapping[str, str | tuple[str, ...]] | None = None
                      ) -> list[inspect.Parameter]:
    """Keyword-only parameters, one ``typer.Option`` per field of ``cls`` (a dataclass).

    ``defaults`` (an instance) gives the default values (else the fields' own; a field with neither is a
    required option); ``flags`` renames options (field name -> ``--flag``, or several names such as
    ``("--stages", "-p")``). A ``bool`` field is a pair, ``--flag`` / ``--no-flag``. Fields with a dataclass
    type (nested configs) are skipped.
    """
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    keep = set(only) if only is not None else None
    params = []
    for f in fields(cls):
        nested = hasattr(hints[f.name], "__dataclass_fields__")
        if (keep is not None and f.name not in keep) or f.name in exclude or nested:
            continue
        annotation = hints[f.name]
        required = defaults is None and f.default is MISSING and f.default_factory is MISSING
        if defaults is not None:
            default = getattr(defaults, f.name)
        else:
            default = f.default if f.default is not MISSING else None  # a factory (a list): None = empty
        if required:
            default = ...
        elif default is None or isinstance(default, list):
            default, annotation = None, annotation | None
        names = (flags or {}).get(f.name, "--" + f.name.replace("_", "-"))
        if annotation is bool and isinstance(names, str) and "/" not in names:  # on and off: --x / --no-x
            names = f"{names}/--no-{names[2:]}"
        option = typer.Option(default, *((names,) if isinstance(names, str) else names),
                              help=option_help(docs.get(f.name, ""), default))
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))
    return params


def option_help(doc: str, default: Any) -> str:
    """A field's docstring as its option's help: the sentence ``Unset (None): ...`` (what the library does with the
    field left None) reads ``Left out: ...`` where the option's default is None, and is dropped where the command
    gives its own default, which the help shows as ``[default: ...]``."""
    if default is None:
        return doc.replace("Unset (None):", "Left out:")
    return re.sub(r"\s*Unset \(None\):[^.]*\.", "", doc)


def set_away(options: Any, names: Iterable[str]) -> str:
    """The options among ``names`` that ``options`` (an options dataclass) holds away from their defaults, as the
    command line says them (``--batch 64, --show-schedule``); empty when there are none."""
    from plait.errors import flag_of

    keep = set(names)
    given = [(f.name, getattr(options, f.name)) for f in fields(options)
             if f.name in keep and f.default is not MISSING and getattr(options, f.name) != f.default]
    return ", ".join(flag_of(n) if v is True else f"{flag_of(n)} {v}" for n, v in given)


def with_options(options: list[inspect.Parameter], into: str) -> Callable[[Callable], Callable]:
    """Decorate a command so that it also takes ``options``; their values reach it as one dict, argument ``into``."""
    names = [p.name for p in options]

    def decorate(fn: Callable) -> Callable:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != into]
        clash = {p.name for p in own} & set(names)
        if clash:
            raise TypeError(f"{fn.__name__}: parameters {sorted(clash)} are also generated options")

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            values = {name: kwargs.pop(name) for name in names}
            return fn(**kwargs, **{into: values})

        params = options + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]  # layout options first
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer must read the generated signature, not fn's
        return command

    return decorate


def typed(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` came from the command line (or the environment), not its default."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def check_cp_comm(cp: int, cp_comm: str) -> None:
    """ConfigError for --cp-comm ring without context parallelism (--cp 1), where nothing exchanges keys and
    values: it would be silently ignored."""
    from plait.errors import ConfigError

    if cp == 1 and cp_comm != "allgather":
        raise ConfigError(f"--cp-comm {cp_comm}: how context-parallel ranks exchange keys and values, but --cp is 1 "
                          "(no context parallelism); add --cp N (N > 1) or leave --cp-comm out")
