"""Every `plait ...` command line shown in the README and docs/ parses with today's CLI (names, types, choices)."""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path

import pytest
import typer

from plait.cli.main import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a command at the start of a code line: `plait ...`, `$ plait ...`, `.venv/bin/plait ...`, or torchrun's worker form
COMMAND = re.compile(r"^\s*(?:\$\s+)?(?:\.venv/bin/)?(?:plait|torchrun .*-m plait\.cli\.main)"
                     r"\s+(?P<args>[a-z][a-z-]*(?=\s|$).*)$")


def _command_lines() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        in_code, held = False, ""
        for line in doc.read_text().splitlines():
            if line.lstrip().startswith("```"):
                in_code, held = not in_code, ""
                continue
            if in_code and line.endswith("\\"):  # a shell line continued on the next: checked whole
                held += line[:-1]
                continue
            line, held = held + line, ""
            match = COMMAND.match(line) if in_code else None
            if match:
                args = match["args"].split(" #")[0].split(";")[0].split("|")[0].strip()
                found.append((f"{doc.name}: {line.strip()}", args))
    return found


def _parse(args: list[str]) -> dict:
    """Parse like the real command line but invoke nothing: unknown options or bad values raise. Returns the
    parameters' values, defaults included."""
    group = typer.main.get_command(app)
    name, *rest = args
    with group.make_context("plait", [], resilient_parsing=True) as parent:
        command = group.get_command(parent, name)
        assert command is not None, f"unknown command {name}"
        with command.make_context(name, rest, parent=parent) as ctx:
            return dict(ctx.params)


LINES = _command_lines()


def test_docs_show_commands():
    assert len(LINES) >= 20, LINES  # the README and docs do show many: the pattern must keep finding them


@pytest.mark.parametrize(("where", "args"), LINES, ids=[w for w, _ in LINES])
def test_command_line_parses(where, args):
    if "--help" in args.split():
        return  # --help exits early by design; its text is tested elsewhere
    _parse(shlex.split(args))


def test_readme_lists_every_layout_field_and_the_commands_options_for_them():
    """The README names ParallelConfig's fields in order; train has an option for each, verify for all but
    precision, as it says."""
    import dataclasses

    from plait import ParallelConfig

    fields = [f.name for f in dataclasses.fields(ParallelConfig)]
    assert f"`plait.ParallelConfig({', '.join(fields)})`" in " ".join((ROOT / "README.md").read_text().split())
    group = typer.main.get_command(app)
    with group.make_context("plait", [], resilient_parsing=True) as parent:
        options = {name: {o for p in group.get_command(parent, name).params for o in p.opts}
                   for name in ("train", "verify")}
    flag = {f: "--" + f.replace("_", "-") for f in fields}
    assert [f for f in fields if flag[f] not in options["train"]] == []
    assert [f for f in fields if flag[f] not in options["verify"]] == ["precision"]


def test_parser_rejects_what_the_cli_rejects():  # the check can fail
    with pytest.raises(Exception, match="No such option"):
        _parse(["simulate", "--no-such-option", "1"])
    with pytest.raises(Exception, match="valid integer"):
        _parse(["train", "--tp", "two"])


# a Python example followed at once by a plain code block: that block is what the example prints
EXAMPLE = re.compile(r"```python\n(?P<code>.*?)```\n```\n(?P<out>.*?)```", re.S)
EXAMPLES = [(f"{doc.name}:{doc.read_text()[:m.start()].count(chr(10)) + 1}", m["code"], m["out"])
            for doc in DOCS for m in EXAMPLE.finditer(doc.read_text())]


def test_docs_show_python_examples_with_their_output():
    assert EXAMPLES, "the pattern must keep finding the planner's example"


@pytest.mark.parametrize(("where", "code", "out"), EXAMPLES, ids=[w for w, _, _ in EXAMPLES])
def test_python_example_prints_what_the_docs_show(where, code, out, capsys):
    exec(compile(code, where, "exec"), {})
    assert capsys.readouterr().out == out, f"{where}: the output shown is not what the example prints"


def _commands(group=None, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command a user runs (``data prepare`` under its group), as its words after ``plait``."""
    group = group or typer.main.get_command(app)
    found: list[tuple[str, ...]] = []
    for name, command in sorted(group.commands.items()):
        found += _commands(command, (*path, name)) if hasattr(command, "commands") else [(*path, name)]
    return found


def _help_examples(words: tuple[str, ...]) -> list[str]:
    """The `plait ...` command lines of a command's --help "Examples:" block (continued lines joined, each
    `&&` part its own command, comments dropped)."""
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    if "Examples:\n" not in res.output:
        return []
    block = res.output.split("Examples:\n", 1)[1].split("\n\n")[0].replace("\\\n", " ")
    parts = [part.split(" #")[0].strip() for line in block.splitlines() for part in line.split("&&")]
    return [m["args"].split(">")[0].strip() for part in parts if (m := COMMAND.match(part))]


# plait's own --help, each group's and each command's
HELPS = [(), ("data",), *_commands()]


def _named(words: tuple[str, ...]) -> str:
    return " ".join(("plait", *words))


@pytest.mark.parametrize("words", HELPS, ids=_named)
def test_every_commands_help_shows_examples_that_parse(words):
    examples = _help_examples(words)
    assert any(shlex.split(e)[:len(words)] == list(words) for e in examples), f"plait {' '.join(words)} --help: " \
        f"no Examples of the command itself ({examples})"
    for example in examples:
        _parse(shlex.split(example))


@pytest.mark.parametrize("words", HELPS, ids=_named)
def test_every_commands_help_fits_80_columns(words):
    """At COLUMNS=80 no line of --help is wider (paragraphs re-flow; examples, tables and other kept blocks are
    written to fit): a wider line folds mid-word in the terminal, or is cut in a narrow window. A group's list of
    commands says each one whole, not cut short with '...'."""
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "80"})
    wide = [line for line in res.output.splitlines() if len(line) > 80]
    assert res.exit_code == 0 and not wide, f"{_named(words)} --help: " + "\n".join(wide)
    listed = res.output.split("Commands:\n", 1)[1].split("\n\n")[0] if "Commands:\n" in res.output else ""
    assert "..." not in listed, f"{_named(words)} --help: {listed}"


@pytest.mark.parametrize("words", [("train",), ("verify",), ("generate",), ("serve",)], ids=_named)
def test_the_examples_that_launch_take_four_processes_at_most(words):
    """Each example of a command that launches processes runs as written on a small host, as its neighbours do:
    its layout, the defaults of the flags it leaves out included, takes 4 processes at most (plait train's
    --tp 1 --dp 4 --ep 4 took 8: --pp is 2 unless given)."""
    for example in _help_examples(words):
        params = _parse(shlex.split(example))
        if params.get("layout") == "auto":
            world = params["nproc"]
        else:
            world = math.prod(max(1, params.get(k) or 1) for k in ("tp", "pp", "dp", "cp"))
        assert world <= 4, f"{_named(words)} --help: {example} takes {world} processes"


def test_the_plan_examples_on_a_calibrated_host_give_the_batch():
    """Without --global-batch plait plan searches the batch among 4-64M tokens, a GPU cluster's: on a CPU host's
    profile (--cluster) the run it writes (--write-config) then takes over an hour a step (small, 4 processes: a
    batch of 4096 x 1024 tokens, 4,775 s predicted). Each example on a profile gives a batch of its own."""
    examples = [shlex.split(e) for e in _help_examples(("plan",))]
    on_hosts = [e for e in examples if e[0] == "plan" and _parse(e)["cluster"]]
    assert on_hosts and all(_parse(e)["global_batch"] for e in on_hosts), on_hosts


# a `$ plait simulate ...` code block: the command, then (the start of) what it prints into a pipe
SIMULATE = re.compile(r"```\n\$ plait (?P<args>simulate [^\n]*)\n(?P<out>.*?)```", re.S)
SIMULATIONS = [(f"{doc.name}:{doc.read_text()[:m.start()].count(chr(10)) + 1}", m["args"], m["out"])
               for doc in DOCS for m in SIMULATE.finditer(doc.read_text())]


@pytest.mark.parametrize(("where", "args", "out"), SIMULATIONS, ids=[w for w, _, _ in SIMULATIONS])
def test_simulate_prints_what_the_docs_show(where, args, out):
    """Each chart or table shown is the first lines of what the command prints, line for line (the docs may stop
    after the chart's time axis); a --width wider than the console is kept, not folded at the console's edge."""
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, shlex.split(args), env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    shown = out.rstrip("\n").splitlines()
    assert [line.rstrip() for line in res.output.splitlines()[:len(shown)]] == shown, f"{where}: not what it prints"


def test_docs_show_simulations():
    assert len(SIMULATIONS) >= 10, SIMULATIONS  # schedules.md draws every schedule


def test_the_options_whose_unset_value_stands_for_one_say_it():
    """An option left unset (None) shows no default in --help; where the command then uses a value of its own, the
    help says which: generate's --prompt is "def " (its help said only "A prompt"), serve without --api-key serves
    every request."""
    from typer.testing import CliRunner

    from plait.cli.generate import DEFAULT_PROMPT

    for words, option, said in ((("generate",), "--prompt", f"default, without --chat or --messages: "
                                                            f"{DEFAULT_PROMPT!r}"),
                                (("serve",), "--api-key", "unset: every request is served")):
        res = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "300"})
        lines = res.output.splitlines()
        start = next(i for i, x in enumerate(lines) if x.strip().startswith(f"{option} "))
        end = next(i for i in range(start + 1, len(lines) + 1) if i == len(lines) or re.match(r" {1,2}\S", lines[i]))
        text = " ".join(" ".join(lines[start:end]).split())  # the option's help, however the terminal wraps it
        assert said in text, f"{_named(words)} --help: {text}"
