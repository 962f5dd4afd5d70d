"""plait's exception types, and the valid choices their messages offer (importable without torch)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import fields
from typing import TypeGuard


class ConfigError(ValueError):
    """An invalid configuration, raised before any collective runs.

    The message names the offending parameter and says what would be valid.
    """


class CommError(RuntimeError):
    """A point-to-point or collective operation failed: a peer died, closed its connection, or hung.

    ``collective`` names the collective that failed (None: a point-to-point transfer, or not known)."""

    collective: str | None = None


class CommTimeoutError(CommError):
    """A rank waited longer than its timeout on a collective or point-to-point operation."""


def is_timeout(exc: BaseException) -> bool:
    """Whether a backend's error (Gloo: "Timed out waiting ...ms for recv operation") says a wait timed out."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def comm_wait(op: Callable[[], object], what: str | Callable[[], str], peer: int | None, timeout_s: float,
              me: str = "") -> None:
    """Run ``op``, a blocking wait for ``what`` from global rank ``peer`` (None: no one rank) that the backend
    ends after ``timeout_s``. Its error becomes a CommTimeoutError ("waited more than 3s for ... from global
    rank 1: <the backend's words, ``backend_words``>") when it says the wait timed out, else a CommError asking
    whether that rank died; ``me`` (the waiting rank in words, e.g. "pipeline rank 0") opens the message.
    ``what`` may be a function giving the words, called only on an error (a wait in a decode loop builds none)."""
    try:
        op()
    except RuntimeError as exc:
        who = f" from global rank {peer}" if peer is not None else ""
        what = what() if callable(what) else what
        if is_timeout(exc):
            raise CommTimeoutError(f"{me + ' ' if me else ''}waited more than {timeout_s:g}s for {what}{who}: "
                                   f"{backend_words(exc)}") from exc
        raise CommError(f"{me + ': ' if me else ''}{what}{who} failed (did that rank die?): {backend_words(exc)}") \
            from exc


def rank_list(ranks: list[int]) -> str:
    """Global ranks in words, runs of consecutive ranks shortened: [0, 1] -> "0,1", [0, 1, 2, 3, 6] -> "0-3,6"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)) for run in runs)


def backend_words(exc: BaseException) -> str:
    """The gist of a backend's error on one line: its first sentence without the source location before it
    (Gloo: "[.../pair.cc:537] Read error [127.0.0.1]:38061: Connection reset by peer. This is typically ..."
    -> "Read error [127.0.0.1]:38061: Connection reset by peer")."""
    text = " ".join(str(exc).split())
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0].rstrip(".")


def collective_error(what: str, ranks: list[int], me: int, exc: BaseException) -> CommError:
    """The error of collective ``what`` (e.g. "dp all-reduce of gradients") over global ``ranks`` that failed on
    global rank ``me`` with the backend's ``exc``: a CommTimeoutError when the backend says it timed out, else a
    CommError asking whether the other member (or one of the others) died. Its peer is named only as the set of
    the other members: a backend's error does not say reliably which one of them stopped answering."""
    others = [r for r in ranks if r != me]
    them = f"global rank {others[0]}" if len(others) == 1 else f"one of global ranks {rank_list(others)}"
    head = f"{what} over global ranks {rank_list(ranks)}"
    if is_timeout(exc):
        err: CommError = CommTimeoutError(f"{head} timed out (is {them} stuck or dead?): {backend_words(exc)}")
    else:
        err = CommError(f"{head} failed (did {them} die?): {backend_words(exc)}")
    err.collective = what
    return err


#: the command-line flag of each library parameter whose flag is not ``--`` and its name with dashes: the one
#: place the Python names (``Cluster(n_gpus=...)``, ``build_schedule(virtual=...)``) meet the flags users type
FLAGS = {"n_gpus": "--gpus", "virtual": "--virtual-stages", "n_layers": "--layers", "n_experts": "--experts"}


def flag_of(name: str) -> str:
    """The command-line flag of library parameter ``name``: ``n_gpus`` -> ``--gpus``, ``seq_len`` -> ``--seq-len``."""
    return FLAGS.get(name, "--" + name.replace("_", "-"))


class FieldError(ConfigError):
    """A ConfigError about one named setting: reads ``name=value: detail``, or as a command-line flag.

    ``others`` are the other settings the detail names, each where its ``{name}`` stands in it: ``pp=2`` in
    the message, ``--pp 2`` on the command line."""

    def __init__(self, name: str, value: object, detail: str, others: dict[str, object] | None = None):
        self.name, self.value, self.detail, self.others = name, value, detail, dict(others or {})
        super().__init__(f"{name}={value!r}: {self._filled(lambda n, v: f'{n}={v!r}')}")

    def _filled(self, say) -> str:
        return self.detail.format(**{n: say(n, v) for n, v in self.others.items()}) if self.others else self.detail

    def as_flag(self) -> str:
        """The same message naming the flags: ``--virtual-stages 3: ...`` (a switch that is on: ``--add: ...``)."""
        flag, detail = flag_of(self.name), self._filled(lambda n, v: flag_of(n) if v is True else f"{flag_of(n)} {v!r}")
        return f"{flag}: {detail}" if self.value is True else f"{flag} {self.value!r}: {detail}"

    def in_file(self, source: str, keys: dict[str, str]) -> ConfigError:
        """The same error naming the keys of file ``source`` that the settings were read from (``keys``: setting
        -> key): ``config.json: num_hidden_layers = 0: ...``, where no flag was typed."""
        def say(n: str, v: object) -> str:
            return f"{keys.get(n, n)} = {v!r}"
        return ConfigError(f"{source}: {say(self.name, self.value)}: {self._filled(say)}")


def flag_message(exc: Exception) -> str:
    """A ConfigError's message as the command line should say it (flags instead of field names)."""
    return exc.as_flag() if isinstance(exc, FieldError) else str(exc)


class MissingExtraError(ConfigError):
    """An optional feature is used without its extra installed; the message says which extra to install."""


def require_extra(extra: str, modules: tuple[str, ...], feature: str) -> None:
    """Raise MissingExtraError naming ``pip install 'plait[extra]'`` if any of ``modules`` cannot be imported."""
    from importlib.util import find_spec

    missing = [m for m in modules if find_spec(m) is None]
    if missing:
        raise MissingExtraError(f"{feature} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                                f"not installed: pip install 'plait[{extra}]'")


def is_integer(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an integer, Python's or numpy's, and not a bool (to Python True is 1; to a check of a
    count or a size it is a mistake)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[float]:
    """Whether ``value`` is a finite real number, Python's or numpy's, and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def plain_number(value: object) -> object:
    """``value`` as Python's int or float when it is another kind of integer or real number (numpy's, from a config
    dict or a user's arithmetic), else unchanged: a bool stays a bool, for its check to refuse. A config holding
    Python's numbers writes them as JSON and TOML and prints them as the user typed them."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def plain_numbers(config: object) -> None:
    """Make every field of dataclass ``config`` that holds an integer or a real number hold Python's (``plain_number``;
    a frozen dataclass too): called by a config's ``__post_init__`` before its checks."""
    for f in fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        plain = plain_number(value)
        if plain is not value:
            object.__setattr__(config, f.name, plain)


_JSON_KINDS = {list: "an array", dict: "an object", str: "a string", bool: "true or false", int: "a number",
               float: "a number", type(None): "null"}


def json_kind(value: object) -> str:
    """What a value read from JSON (or a Parquet column) is, in JSON's words: 'null', 'a number', 'an array', ..."""
    return _JSON_KINDS.get(type(value), type(value).__name__)


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending: the sizes a message offers for splitting ``n`` things evenly."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_output_path(flag: str, path: str | None, folder: bool) -> None:
    """ConfigError naming ``flag`` when ``path`` cannot become a folder (``folder``) or a file: a file where a folder
    goes or the other way round, or a path through a file. Checked before the work whose result goes there."""
    from pathlib import Path

    if path is None:
        return
    p = Path(path)
    if p.exists() and p.is_dir() != folder:
        raise ConfigError(f"{flag} {path}: {'a file, not a folder' if folder else 'a folder, not a file'}")
    above = next(a for a in p.absolute().parents if a.exists())
    if not p.exists() and not above.is_dir():
        raise ConfigError(f"{flag} {path}: {above} is a file, so nothing can be made under it")
