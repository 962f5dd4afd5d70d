"""A checkpoint of a model trained from a folder with a tokenizer.json decodes with that tokenizer wherever it is
read from, its export carries the tokenizer, and a tokenizer gone missing is an error, never UTF-8 bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from typer.testing import CliRunner

from data_util import EOS, bpe_folder
from plait.cli.main import app
from plait.models import Llama, LlamaConfig
from plait.tokenizers import fingerprint_file

#: plait train --model bpe-model --steps 1 --seq-len 16 ... --data text --checkpoint-dir ckpt, of one process
TRAIN = dict(model="bpe-model", tp=1, pp=1, dp=1, steps=1, seq_len=16, batch_size=2, microbatches=1, eval_every=0,
             sample_tokens=0, data=["text"], checkpoint_dir="ckpt")
GENERATE = ["generate", "--prompt", "the parallel", "--max-new-tokens", "6"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A folder holding bpe-model/ (a Llama and a BPE tokenizer.json) and ckpt/, one step trained from it (plait
    train's loop, run in this process from that folder: the paths given relative to it, as on a command line)."""
    from plait.train import TrainConfig, train

    tmp_path = tmp_path_factory.mktemp("trained")
    torch.manual_seed(0)
    Llama(LlamaConfig(vocab_size=400, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=32)
          ).save_pretrained(tmp_path / "bpe-model")
    bpe_folder(tmp_path / "bpe-model", 400)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("the parallel pipeline stage sends activations " * 40)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        train(TrainConfig.from_dict(TRAIN))
    return tmp_path


def test_checkpoint_keeps_its_tokenizer_from_anywhere_and_export_copies_it(trained, monkeypatch):
    meta = json.loads((trained / "ckpt" / "step_00000001" / "meta.json").read_text())
    eos = Tokenizer.from_file(str(trained / "bpe-model" / "tokenizer.json")).token_to_id(EOS)
    assert meta["tokenizer"] == {"folder": str((trained / "bpe-model").resolve()),  # and where its documents end
                                 "fingerprint": fingerprint_file(trained / "bpe-model" / "tokenizer.json"), "eos": eos}
    monkeypatch.chdir(trained)
    here = CliRunner().invoke(app, [*GENERATE, "--model", "ckpt"])
    assert here.exit_code == 0, here.output
    (trained / "elsewhere").mkdir()
    monkeypatch.chdir(trained / "elsewhere")  # --model bpe-model was relative to the training run's directory
    there = CliRunner().invoke(app, [*GENERATE, "--model", "../ckpt"])
    assert there.exit_code == 0 and there.stdout == here.stdout, there.output  # was decoded as UTF-8 bytes
    exported = CliRunner().invoke(app, ["export", "../ckpt", "../hf"])
    assert exported.exit_code == 0 and "tokenizer.json, tokenizer_config.json" in exported.stdout, exported.output
    assert exported.stdout.startswith("exporting ../ckpt/step_00000001 ...\n"), exported.stdout  # which step
    assert fingerprint_file(trained / "hf" / "tokenizer.json") == meta["tokenizer"]["fingerprint"]
    assert json.loads((trained / "hf" / "config.json").read_text())["eos_token_id"] == eos  # generation stops there
    again = CliRunner().invoke(app, [*GENERATE, "--model", "../hf"])
    assert again.exit_code == 0 and again.stdout == here.stdout, again.output

    shutil.move(trained / "bpe-model", trained / "moved")  # or the checkpoint copied to another machine
    kept = trained / "ckpt" / "step_00000001" / "tokenizer"
    try:  # the checkpoint's own copy of the folder's tokenizer files: as before the move
        moved = CliRunner().invoke(app, [*GENERATE, "--model", "../ckpt"])
        assert moved.exit_code == 0 and moved.stdout == here.stdout, moved.output  # was 'put the folder back'
        exported = CliRunner().invoke(app, ["export", "../ckpt", "../hf-moved"])
        assert exported.exit_code == 0 and "tokenizer.json, tokenizer_config.json" in exported.stdout, exported.output
        assert fingerprint_file(trained / "hf-moved" / "tokenizer.json") == meta["tokenizer"]["fingerprint"]
        shutil.move(kept, trained / "kept")  # a checkpoint saved without the copy: the folder or a refusal
        for args in ([*GENERATE, "--model", "../ckpt"], ["export", "../ckpt", "../hf2"]):
            gone = CliRunner().invoke(app, args)
            assert gone.exit_code == 2, gone.output
            assert f"trained with the tokenizer of {trained.resolve() / 'bpe-model'}, and" in gone.stderr, gone.stderr
        assert not (trained / "hf2").exists(), "nothing is written before the refusal"
    finally:
        shutil.move(trained / "moved", trained / "bpe-model")
        if (trained / "kept").exists():
            shutil.move(trained / "kept", kept)


def test_export_takes_the_token_ids_of_the_generation_config_beside_the_tokenizer(trained, tmp_path):
    """config.json of an export said bos_token_id null though the model's generation_config.json, copied with its
    tokenizer, names its bos and pad ids; eos stays the end-of-document token the run trained with."""
    from plait.checkpoint.store import export_pretrained

    shutil.copytree(trained / "ckpt", tmp_path / "ckpt")  # its tokenizer files: the copy the checkpoint keeps
    kept = tmp_path / "ckpt" / "step_00000001" / "tokenizer"
    (kept / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 3],
                                                             "pad_token_id": 0}))
    export_pretrained(tmp_path / "ckpt", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    eos = Tokenizer.from_file(str(kept / "tokenizer.json")).token_to_id(EOS)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, eos, 0), config


def test_a_byte_level_export_with_force_removes_the_folders_other_tokenizer(trained, tmp_path, monkeypatch):
    """A folder holding another model's tokenizer was refused under --force too; --force now replaces that model,
    its tokenizer files with it (a byte-level model has none to read in their place), and says so."""
    shutil.copytree(trained / "ckpt", tmp_path / "ckpt")
    meta_file = tmp_path / "ckpt" / "step_00000001" / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["tokenizer"] = {"folder": None, "fingerprint": "bytes"}  # as a preset's checkpoint records it
    meta_file.write_text(json.dumps(meta))
    shutil.copytree(trained / "bpe-model", tmp_path / "other")
    monkeypatch.chdir(tmp_path)
    refused = CliRunner().invoke(app, ["export", "ckpt", "other"])  # a folder no plait export wrote
    assert refused.exit_code == 2 and "is not a folder plait export wrote" in refused.stderr, refused.output
    res = CliRunner().invoke(app, ["export", "ckpt", "other", "--force"])
    assert res.exit_code == 0, res.output
    assert "tokenizer.json, tokenizer_config.json before writing: the model other held (--force)" in res.stdout
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["config.json", "model.safetensors"]


def test_export_refuses_a_folder_holding_other_weights(trained, tmp_path, monkeypatch):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old shard")  # a sharded checkpoint exported over
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    monkeypatch.chdir(trained)
    res = CliRunner().invoke(app, ["export", "ckpt", str(out)])  # no plait export wrote them
    assert res.exit_code == 2 and res.stderr.startswith(f"error: OUT {out}: holds model-00001-of-00002.safetensors, "
                                                        "model.safetensors.index.json, and is not a folder"), res.output
    res = CliRunner().invoke(app, ["export", "ckpt", str(out), "--force"])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: {out}: holds other weights (model-00001-of-00002"
                                                        ".safetensors, model.safetensors.index.json)"), res.output
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00002.safetensors",
                                                     "model.safetensors.index.json"]  # nothing written
    again = CliRunner().invoke(app, ["export", "ckpt", str(tmp_path / "fresh")])
    assert again.exit_code == 0
    assert CliRunner().invoke(app, ["export", "ckpt", str(tmp_path / "fresh")]).exit_code == 0  # its own export


def test_a_folder_whose_weights_do_not_match_its_config_is_one_error_line(tmp_path):
    torch.manual_seed(0)
    Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=1, n_heads=2, max_seq_len=32)).save_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "head_dim": 32}))
    train = ["train", "--tp", "1", "--pp", "1", "--microbatches", "1", "--seq-len", "16"]
    for command in (["generate"], ["serve"], train):
        res = CliRunner().invoke(app, [*command, "--model", str(tmp_path / "m")])  # was a load_state_dict traceback
        assert res.exit_code == 2 and res.output.startswith(
            f"error: {tmp_path / 'm'}: model.embed_tokens.weight is [256, 32] in its safetensors files, but its "
            "config.json makes it [256, 64]"), (command, res.output)


def test_export_of_what_is_not_a_checkpoint_says_what_it_takes(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    res = CliRunner().invoke(app, ["export", str(tmp_path / "hf"), str(tmp_path / "out")])
    assert res.exit_code == 2 and res.stderr.startswith(  # was "hf: no plait checkpoint there"
        f"error: CHECKPOINT {tmp_path / 'hf'}: a Hugging Face folder already (config.json), not a plait checkpoint: "
        "plait train, generate and serve take it as --model as it is"), res.output
    (tmp_path / "gpt2").mkdir()  # a family plait does not read: nothing takes it as it is
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    res = CliRunner().invoke(app, ["export", str(tmp_path / "gpt2"), str(tmp_path / "out")])
    assert res.exit_code == 2 and res.stderr == (
        f"error: CHECKPOINT {tmp_path / 'gpt2'}: a Hugging Face folder (config.json), not a plait checkpoint, and not "
        "one plait reads either: model_type='gpt2' is not supported; supported model types: llama, mistral, "
        "mixtral, qwen2, qwen3, qwen3_moe\n"), res.output
    res = CliRunner().invoke(app, ["export", str(tmp_path / "nope"), str(tmp_path / "out")])
    assert res.exit_code == 2 and res.stderr == (
        f"error: CHECKPOINT {tmp_path / 'nope'}: no plait checkpoint there (a step_* folder that plait train saved, or "
        "the --checkpoint-dir holding them)\n"), res.output
    assert not (tmp_path / "out").exists()


def test_a_model_saved_back_into_its_folder_keeps_the_folders_token_ids(tmp_path):
    """save_pretrained writes no token ids of its own (a plain model knows no tokenizer); saved back where it was
    read from, the folder's ids stay (not overwritten with null, which would leave generation never stopping at EOS)."""
    Llama(LlamaConfig(vocab_size=97, dim=32, n_layers=1, n_heads=2, max_seq_len=32)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] is None and config["bos_token_id"] is None
    (tmp_path / "config.json").write_text(json.dumps({**config, "bos_token_id": 1, "eos_token_id": [2, 5]}))
    Llama.from_pretrained(tmp_path).save_pretrained(tmp_path)
    again = json.loads((tmp_path / "config.json").read_text())
    assert again == {**config, "bos_token_id": 1, "eos_token_id": [2, 5]}
