"""What `pip install .` gives must work: every import declared, optional features name their extra, no silent
fallbacks, one option vocabulary across commands."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from file_module import load
from plait.cli.main import app
from plait.errors import ConfigError, MissingExtraError, require_extra

ROOT = Path(__file__).resolve().parents[1]


def _scanner():
    """The import checker CI also runs on the installed wheel (.ci/declared_imports.py): one implementation."""
    return load(".ci/declared_imports.py", "declared_imports")


def test_every_import_is_declared():
    scan = _scanner()
    base, extras = scan.from_pyproject(ROOT / "pyproject.toml")
    problems = scan.undeclared(scan.third_party_imports(ROOT / "src" / "plait"), base, extras)
    assert not problems, "\n".join(problems)


def test_the_scan_can_fail():  # not vacuous: it sees real imports and flags a transitive-only package
    scan = _scanner()
    found = scan.third_party_imports(ROOT / "src" / "plait")
    assert {"torch", "typer", "safetensors", "tokenizers", "fastapi"} <= set(found)
    base, extras = scan.from_pyproject(ROOT / "pyproject.toml")
    click_user = {"click": {"plait/cli/train.py"}}  # click arrives with huggingface_hub, yet is not declared
    assert scan.undeclared(click_user, base, extras) == [
        "plait/cli/train.py imports 'click' (click), not declared in the base dependencies"]
    pyarrow_outside_data = {"pyarrow": {"plait/train/loop.py"}}  # declared, but only for the data extra
    assert len(scan.undeclared(pyarrow_outside_data, base, extras)) == 1


def test_missing_extra_names_the_pip_command():
    with pytest.raises(MissingExtraError) as info:
        require_extra("serve", ("json", "surely_not_installed_pkg"), "plait serve")
    assert isinstance(info.value, ConfigError)
    assert str(info.value) == ("plait serve needs surely_not_installed_pkg, which is not installed: "
                               "pip install 'plait[serve]'")
    require_extra("serve", ("json",), "plait serve")  # present: no error


# ---------------------------------------------------------------------------------------------- tokenizers
def _write_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "def": 1, "class": 2, "x": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_folder_tokenizer_is_used_not_bytes(tmp_path):
    from plait.tokenizers import FileTokenizer, tokenizer_for

    tok = tokenizer_for(str(_write_tokenizer(tmp_path / "m")))
    assert isinstance(tok, FileTokenizer) and tok.vocab_size == 4
    assert tok.encode("def x class") == [1, 3, 2]  # bytes would give 11 ids
    assert tokenizer_for(str(tmp_path / "no-tokenizer-here")).encode("ab") == [97, 98]


def test_tokenizer_without_package_is_an_error_naming_it(tmp_path, monkeypatch):
    from plait.tokenizers import tokenizer_for

    folder = _write_tokenizer(tmp_path / "m")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed: import raises ImportError
    with pytest.raises(ConfigError, match="needs the 'tokenizers' package.*pip install tokenizers"):
        tokenizer_for(str(folder))


def test_broken_tokenizer_file_is_an_error(tmp_path):
    from plait.tokenizers import tokenizer_for

    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a Hugging Face tokenizer.json"):
        tokenizer_for(str(tmp_path))


# ------------------------------------------------------------------------------------ one option vocabulary
def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


def test_virtual_stages_is_one_name_with_the_old_alias_hidden():
    import json

    new = _cli("simulate", "-s", "interleaved-1f1b", "-p", "4", "-m", "8", "--virtual-stages", "3", "--json")
    old = _cli("simulate", "-s", "interleaved-1f1b", "-p", "4", "-m", "8", "--virtual", "3", "--json")
    assert new.exit_code == 0 and old.exit_code == 0, new.output + old.output
    assert json.loads(new.output)["num_stages"] == json.loads(old.output)["num_stages"] == 12
    for command in ("simulate", "train", "verify"):
        shown = _cli(command, "--help").output
        assert "--virtual-stages" in shown, command
        assert not re.search(r"--virtual(?![-\w])", shown), f"{command} --help still shows --virtual"


def test_one_default_virtual_for_interleaved():
    from plait.schedules import build_schedule
    from plait.train.config import TrainConfig
    from plait.verify import VerifyConfig

    assert TrainConfig().parallel.virtual_stages is None and VerifyConfig().parallel.virtual_stages is None
    assert build_schedule("interleaved-1f1b", 4, 8, virtual=None).virtual == 2
    sim = _cli("simulate", "-s", "interleaved-1f1b", "-p", "4", "-m", "8", "--json")
    assert sim.exit_code == 0 and '"virtual": 2' in sim.output


@pytest.mark.parametrize("command", ["train", "verify"])
def test_recompute_flag(command):
    assert "--recompute" in _cli(command, "--help").output
    bad = _cli(command, "--recompute", "sometimes", *(["--nproc", "4"] if command == "train" else []))
    assert bad.exit_code == 2
    assert "recompute" in bad.output and "none, selective, full" in bad.output


def test_help_names_values_as_they_are_typed():
    """Every command's --help: INT, FILE, [WEIGHT:]PATH, SRC... where typer wrote <int>, <path>, <list[str]>."""
    import typer

    group = typer.main.get_command(app)
    commands = [[name] for name in group.commands if name != "data"] + [["data", "prepare"]]
    for words in commands:
        shown = _cli(*words, "--help").output
        assert not re.search(r"<(int|float|str|path|bool|list\[\w+\]|\w+ range)>", shown), (words, shown)
    shown = " ".join(_cli("train", "--help").output.split())
    assert "--tp INT " in shown and "--lr FLOAT " in shown and "--data [WEIGHT:]PATH " in shown, shown
    assert "--config FILE " in shown and "--resume / --no-resume " in shown, shown
    shown = " ".join(_cli("data", "prepare", "--help").output.split())
    assert "SRC... Files or folders to read." in shown and "--out DIR " in shown, shown
    assert "export [OPTIONS] {CHECKPOINT} {OUT}" in _cli("export", "--help").output  # as its errors name them
