"""plait train and generate refuse what cannot run before launching anything, each in one error line: bad flags,
model folders without weights or with damaged ones, a damaged or foreign checkpoint, output paths, config files."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from plait.cli.main import app


@pytest.mark.parametrize("args,needle", [
    (["--model", "gigantic"], "--model 'gigantic'"),
    (["--data", "/no/such/path"], "--data /no/such/path: no such file"),
    (["--tp", "3", "--pp", "2", "--nproc", "4"], "the world has 4"),
    (["--tp", "3", "--pp", "1"], "--tp 3 does not fit"),
    (["--schedule", "zigzag"], "--schedule 'zigzag'"),
    (["--seq-len", "1024", "--cp", "2", "--dp", "1", "--tp", "1", "--pp", "1", "--dry-run"],  # no way on was named
     "error: --seq-len 1024 exceeds the model's max_seq_len 512 (--model tiny): valid --seq-len 1 to 512; the presets' "
     "contexts are tiny 512, small 1024, a --model folder's config.json sets its own (max_position_embeddings)"),
    (["--batch-size", "6"], "--batch-size 6 must be a multiple of --dp x --microbatches = 1 x 4 = 4 (each "
                            "replica's sequences cut into equal micro-batches): valid --batch-size 4, 8, 12, ...; or "
                            "--microbatches 1, 2, 3 or 6, which divide a replica's 6 sequences"),  # named no choice
    (["--batch-size", "2", "--dp", "2", "--tp", "1", "--pp", "2", "--microbatches", "2", "--dry-run"],
     "--dp x --microbatches = 2 x 2 = 4 (each replica's sequences cut into equal micro-batches): valid --batch-size "
     "4, 8, 12, ...; or --microbatches 1, which divides a replica's 1 sequence"),
    (["--steps", "0"], "error: --steps 0: must be a positive integer"),  # as every other flag: --flag value
    (["--seq-len", "0"], "error: --seq-len 0: must be a positive integer"),
    (["--microbatches", "0"], "error: --microbatches 0: must be a positive integer (or left unset: the default)"),
    (["--nproc", "0", "--dry-run"], "error: --nproc 0: must be a positive integer"),
    (["--nproc", "0", "--layout", "auto", "--dry-run"], "error: --nproc 0: must be a positive integer"),
    (["--layout", "auto", "--nproc", "2", "--dry-run", "--cluster", "none"],  # was: the search, then this
     "error: --dry-run: it prints the prediction, and --cluster none turns that off"),
    (["--pp", "2", "--zero", "3", "--schedule", "zbv"], "error: --schedule 'zbv': not with --zero 3: "),
    (["--layout", "auto", "--nproc", "2", "--tp", "2", "--schedule", "zbv", "--dry-run"],  # not silently replaced
     "error: --tp, --schedule: --layout auto chooses the whole layout (all but --precision); drop them"),
    (["--warmup", "-1", "--dry-run"], "--warmup -1: must be >= 0"),
    (["--clip", "-1", "--dry-run"], "--clip -1.0: must be >= 0"),
    (["--weight-decay", "-0.1", "--dry-run"], "--weight-decay -0.1: must be >= 0"),
    (["--sample-tokens", "-1", "--dry-run"], "--sample-tokens -1: must be >= 0"),
    (["--eval-every", "-5", "--dry-run"], "--eval-every -5: must be >= 0"),
    (["--max-data-mb", "0", "--dry-run"], "--max-data-mb 0.0: must be > 0"),
    (["--weight-decay", "inf", "--dry-run"], "--weight-decay inf: must be a finite number >= 0"),  # was taken
    (["--lr", "nan", "--dry-run"], "--lr nan: must be a finite number > 0"),
    (["--resume", "--checkpoint-dir", "/no/such/ckpts", "--dry-run"], "--resume: no checkpoint in --checkpoint-dir"),
    (["--resume", "--auto-resume", "--dry-run"], "error: --resume, --auto-resume: choose one"),  # --resume won
    (["--cp-comm", "ring", "--dry-run"], "error: --cp-comm ring: how context-parallel ranks exchange keys and "
                                         "values, but --cp is 1"),  # was silently ignored
    (["--experts", "6", "--ep", "4", "--dp", "4", "--tp", "1", "--pp", "1", "--nproc", "4", "--dry-run"],
     "error: --ep 4: must divide --experts 6: each EP rank holds an equal share of the experts; valid: [1, 2, 3, 6]"),
    (["--experts", "4", "--ep", "4", "--dp", "2", "--tp", "2", "--pp", "1", "--nproc", "4", "--expert-tp",
      "--dry-run"], "error: --ep 4: must divide --dp 2 with --expert-tp (every TP rank holds a shard"),
    (["--experts", "4", "--top-k", "2", "--capacity-factor", "0", "--dry-run"], "error: --capacity-factor 0.0: must be "
                                                                              "a finite number > 0"),
    (["--experts", "4", "--aux-loss-coef", "-1", "--dry-run"], "error: --aux-loss-coef -1.0: must be a finite number "
                                                               ">= 0 (0: no load-balancing loss)"),
    (["--capacity-factor", "1.25", "--dry-run"], "error: --capacity-factor 1.25: --model tiny has no experts to route"),
    (["--aux-loss-coef", "0.1", "--dry-run"], "error: --aux-loss-coef 0.1: --model tiny has no experts to route"),
    (["--experts", "4", "--capacity-factor", "1.25", "--cp", "2", "--tp", "1", "--pp", "1", "--dry-run"],
     "error: --capacity-factor 1.25 with --cp 2: expert capacity ranks a whole sequence's tokens"),
])
def test_bad_flags_fail_with_one_line(args, needle):
    res = CliRunner().invoke(app, ["train", *args])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert needle in lines[0] and "Traceback" not in res.output


def test_a_model_folder_without_weights_is_refused_naming_what_is_missing(tmp_path):
    """A folder of only config.json and tokenizer files: --model DIR starts from the folder's weights."""
    from plait.model_presets import PRESETS
    from plait.models import Llama, LlamaConfig

    folder = tmp_path / "m"
    Llama(LlamaConfig(**PRESETS["tiny"])).save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    (folder / "tokenizer_config.json").write_text("{}")
    res = CliRunner().invoke(app, ["train", "--model", str(folder), "--tp", "1", "--pp", "1", "--dry-run"])
    assert res.exit_code == 2, res.output
    assert res.output == (f"error: --model {folder}: no weights in the folder (it holds config.json, "
                          "tokenizer_config.json): a model folder starts from its *.safetensors files, or "
                          "model.safetensors.index.json and its shards; pickled .bin weights are not read. Add the "
                          "weights (`plait export CHECKPOINT DIR` writes a whole folder), or start a fresh model "
                          "from a preset (plait train --model tiny or small)\n")


@pytest.mark.parametrize("damage", ["cut short", "shard missing", "index damaged"])
def test_a_model_folder_with_a_damaged_weights_file_is_one_error_naming_the_file(tmp_path, damage):
    """A copy or download that stopped: the safetensors file cut short, a shard the index lists gone, an index
    without its weight_map. Each was a traceback (SafetensorError, FileNotFoundError, KeyError)."""
    from safetensors.torch import save_file

    from plait.model_presets import PRESETS
    from plait.models import Llama, LlamaConfig

    folder = tmp_path / "m"
    Llama(LlamaConfig(**PRESETS["tiny"])).save_pretrained(folder)
    weights = folder / "model.safetensors"
    if damage == "cut short":
        weights.write_bytes(weights.read_bytes()[:-5000])
        needle = "model.safetensors cannot be read ("
    else:
        from safetensors.torch import load_file

        state = load_file(weights)
        weights.unlink()
        names = sorted(state)
        half = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
                "model-00002-of-00002.safetensors": names[len(names) // 2:]}
        for file, keys in half.items():
            save_file({k: state[k] for k in keys}, folder / file)
        index = {"weight_map": {k: file for file, keys in half.items() for k in keys}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index if damage == "shard missing" else {}))
        if damage == "shard missing":
            (folder / "model-00002-of-00002.safetensors").unlink()
        needle = {"shard missing": "model-00002-of-00002.safetensors is missing, though model.safetensors.index.json "
                                   "lists it",
                  "index damaged": "model.safetensors.index.json is damaged (no JSON weight_map"}[damage]
    res = CliRunner().invoke(app, ["train", "--model", str(folder), "--tp", "1", "--pp", "1", "--dry-run"])
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: --model {folder}: {needle}") and len(res.output.splitlines()) == 1, \
        res.output


@pytest.mark.parametrize(("change", "needle"), [
    ({"vocab_size": None}, "config.json has no 'vocab_size', which every llama folder gives"),  # was a KeyError
    ({"num_hidden_layers": 0}, "config.json: num_hidden_layers = 0: must be a positive integer"),
    ({"model_type": "gpt2"}, "config.json: model_type='gpt2' is not supported; supported model types: llama"),
])
def test_a_model_folders_config_json_is_named_in_its_error(tmp_path, change, needle):
    """What is wrong in a folder's config.json names the folder and the file, and a missing key is no traceback."""
    from plait.model_presets import PRESETS
    from plait.models import Llama, LlamaConfig

    folder = tmp_path / "m"
    Llama(LlamaConfig(**PRESETS["tiny"])).save_pretrained(folder)
    config = {**json.loads((folder / "config.json").read_text()), **change}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    for args in (["train", "--model", str(folder), "--tp", "1", "--pp", "1", "--dry-run"],
                 ["generate", "--model", str(folder), "--prompt", "hi"]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and res.output.startswith(f"error: --model {folder}: {needle}"), (args, res.output)
        assert len(res.output.splitlines()) == 1, res.output


def test_resume_with_another_model_says_what_differs_before_launching(tmp_path):
    from plait.checkpoint.store import FORMAT, META
    from plait.train.config import TrainConfig, model_config

    saved = json.loads(json.dumps(model_config(TrainConfig()).to_dict()))  # the tiny preset, as a save writes it
    done = tmp_path / "ckpt" / "step_00000005"
    done.mkdir(parents=True)
    (done / META).write_text(json.dumps({"format": FORMAT, "step": 5, "model": saved, "train": {"model": "tiny"}}))
    res = CliRunner().invoke(app, ["train", "--resume", "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "9",
                                   "--model", "small", "--dry-run"])
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: --resume: {done} holds another model than --model small (dim 128 -> 256"), \
        res.output
    assert "(--model tiny)" in res.output
    res = CliRunner().invoke(app, ["train", "--auto-resume", "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps",
                                   "9", "--experts", "2", "--dry-run"])
    assert res.exit_code == 2 and res.output.startswith(f"error: --auto-resume: {done} holds another model than "
                                                        "--model tiny (n_experts 1 -> 2"), res.output


def test_a_checkpoint_saved_before_a_model_field_existed_still_resumes(tmp_path):
    """A saved model config without a field the config class has since gained (here layer_types, at its default
    None) holds the same model: check_resume takes it."""
    from plait.checkpoint.store import FORMAT, META
    from plait.train.config import TrainConfig, model_config
    from plait.train.restart import check_resume

    saved = json.loads(json.dumps(model_config(TrainConfig()).to_dict()))
    assert saved.pop("layer_types") is None
    done = tmp_path / "ckpt" / "step_00000005"
    done.mkdir(parents=True)
    (done / META).write_text(json.dumps({"format": FORMAT, "step": 5, "model": saved, "train": {"model": "tiny"}}))
    assert check_resume(TrainConfig(resume=True, checkpoint_dir=str(tmp_path / "ckpt"), dry_run=True)) == (done, 5)


def test_a_damaged_checkpoint_is_a_config_error_naming_the_file(tmp_path):
    import torch
    from safetensors.torch import save_file

    from plait.checkpoint import CheckpointReader
    from plait.checkpoint.store import FORMAT, META
    from plait.errors import ConfigError

    ck = tmp_path / "ck"  # --checkpoint-dir: a folder of checkpoints, here one
    step = ck / "step_00000001"
    step.mkdir(parents=True)
    meta = {"format": FORMAT, "step": 1, "tensors": {"w": {"shape": [2], "dtype": "float32", "shards": [
        {"file": "pp0-tp0-dp0.safetensors", "dim": None, "start": 0, "stop": 2}]}}}
    (step / META).write_text(json.dumps(meta))
    shard = step / "pp0-tp0-dp0.safetensors"
    save_file({"w": torch.ones(2)}, str(shard))
    assert CheckpointReader(step).read("w").tolist() == [1.0, 1.0]
    resume = ["train", "--resume", "--checkpoint-dir", str(ck), "--dry-run"]
    shard.unlink()
    with pytest.raises(ConfigError, match="pp0-tp0-dp0.safetensors is missing, though meta.json lists it"):
        CheckpointReader(step).read("w")
    res = CliRunner().invoke(app, resume)  # refused before launching, not by one rank after (its dry run passed)
    assert res.exit_code == 2 and res.output.startswith(f"error: {step}: pp0-tp0-dp0.safetensors is missing"), \
        res.output
    shard.write_text("junk")
    with pytest.raises(ConfigError, match="pp0-tp0-dp0.safetensors cannot be read .*the checkpoint is damaged"):
        CheckpointReader(step).read("w")
    res = CliRunner().invoke(app, resume)
    assert res.exit_code == 2 and "pp0-tp0-dp0.safetensors cannot be read" in res.output, res.output
    (step / META).write_text("{")
    with pytest.raises(ConfigError, match="meta.json is not valid JSON"):
        CheckpointReader(step)


def test_output_paths_that_cannot_be_made_fail_before_launching(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    for args, needle in ((["--checkpoint-dir", "a-file"], "error: --checkpoint-dir a-file: a file, not a folder"),
                         (["--metrics", "a-file/m.jsonl"], f"error: --metrics a-file/m.jsonl: {tmp_path / 'a-file'} "
                                                           "is a file"),
                         (["--metrics", "."], "error: --metrics .: a folder, not a file")):
        res = CliRunner().invoke(app, ["train", "--dry-run", *args])
        assert res.exit_code == 2 and res.output.startswith(needle), (args, res.output)


def test_ep_not_dividing_a_mixtral_folder_s_experts_names_the_model_not_experts_flag(tmp_path):
    """No --experts was typed (a folder brings its own): the refusal names --model and its number of experts."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 32, "vocab_size": 300, "num_hidden_layers": 1,
        "num_attention_heads": 4, "intermediate_size": 48, "num_local_experts": 6, "num_experts_per_tok": 2}))
    res = CliRunner().invoke(app, ["train", "--model", str(tmp_path), "--ep", "4", "--dp", "4", "--tp", "1", "--pp",
                                   "1", "--nproc", "4", "--dry-run"])
    assert res.exit_code == 2 and res.output == (f"error: --ep 4: must divide the 6 experts of --model {tmp_path}; "
                                                 "valid: [1, 2, 3, 6]\n"), res.output


def test_a_model_folder_with_a_broken_config_json_is_one_error_line(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{")
    for command in (["train", "--dry-run"], ["generate"], ["serve"]):
        res = CliRunner().invoke(app, [*command, "--model", str(tmp_path / "m")])
        assert res.exit_code == 2, (command, res.output)
        assert res.output.startswith(f"error: --model {tmp_path / 'm'}: {tmp_path / 'm' / 'config.json'} is not "
                                     "valid JSON ("), (command, res.output)


def test_generate_bad_flags_fail_before_launching(tmp_path):
    from serve_util import tiny_model

    model = str(tiny_model(tmp_path / "m"))
    for args, needle in ((["--temperature", "-1"], "error: --temperature -1.0: must be >= 0"),
                         (["--max-new-tokens", "-5"], "error: --max-new-tokens -5: must be >= 0"),
                         (["--tp", "3"], "error: --tp 3 does not fit --model"),
                         (["--pp", "8"], "error: --pp 8: --model"),
                         (["--prompt", ""], "error: --prompt '': no tokens"),  # was unnamed, from the decoder
                         (["--top-k", "5"], "error: --top-k 5: greedy decoding (--temperature 0, the default) always "
                                            "takes the most likely token, so it has no effect"),  # were ignored
                         (["--seed", "0", "--top-k", "3"], "error: --top-k 3, --seed 0: greedy decoding"),
                         (["--max-new-tokens", "1000"], "error: --max-new-tokens 1000: --prompt 'hi' is 2 tokens, "
                                                        "and 2 + 1000 exceeds the model's 128 positions; give at "
                                                        "most --max-new-tokens 126")):  # named no flag, launched
        res = CliRunner().invoke(app, ["generate", "--model", model, "--prompt", "hi", *args])
        assert res.exit_code == 2 and res.output.startswith(needle), (args, res.output)


def test_config_file_keys_match_flags(tmp_path):
    from plait.train.config import read_toml

    f = tmp_path / "run.toml"
    f.write_text('tp = 1\npp = 4\nseq-len = 64\ndata = ["a.txt"]\n')
    assert read_toml(f) == {"tp": 1, "pp": 4, "seq_len": 64, "data": ["a.txt"]}
    f.write_text("warp = 9\n")
    res = CliRunner().invoke(app, ["train", "--config", str(f)])
    assert res.exit_code == 2 and "unknown key 'warp'" in res.output


@pytest.mark.parametrize("line,needle", [
    ('lr = "fast"', "lr = 'fast': must be a number"),
    ('warmup = "a"', "warmup = 'a': must be an integer"),
    ("model = 5", "model = 5: must be a string"),
    ("data = 5", "data = 5: must be a string or a list of strings"),
    ('resume = "yes"', "resume = 'yes': must be true or false"),
])
def test_config_file_value_of_the_wrong_type_is_one_error_line(tmp_path, line, needle):
    f = tmp_path / "run.toml"
    f.write_text(line + "\n")
    res = CliRunner().invoke(app, ["train", "--config", str(f), "--dry-run"])
    assert res.exit_code == 2 and res.output.strip() == f"error: --config {f}: {needle}", res.output


def test_config_file_number_settings_take_integers(tmp_path):
    from plait.train.config import read_toml

    f = tmp_path / "run.toml"
    f.write_text('lr = 1\nclip = 0\ndata = "a.txt"\n')
    assert read_toml(f) == {"lr": 1.0, "clip": 0.0, "data": ["a.txt"]}


def test_a_flag_on_by_default_can_be_turned_off(tmp_path):
    """A boolean option is a pair (--async-checkpoint / --no-async-checkpoint): the run's summary names the
    off switch, so it must parse; the config file's value is overridden by it."""
    import typer

    from plait.cli import train as cli_train

    seen = {}
    params = {p.name: p for p in typer.main.get_command(app).commands["train"].params}
    assert params["async_checkpoint"].secondary_opts == ["--no-async-checkpoint"]
    f = tmp_path / "run.toml"
    f.write_text("async-checkpoint = true\n")
    real = cli_train._run
    try:
        cli_train._run = lambda cfg: seen.update(cfg=cfg)
        res = CliRunner().invoke(app, ["train", "--config", str(f), "--no-async-checkpoint", "--sequence-parallel"])
    finally:
        cli_train._run = real
    assert res.exit_code == 0, res.output
    assert seen["cfg"].async_checkpoint is False and seen["cfg"].parallel.sequence_parallel is True


@pytest.mark.parametrize("tokenizer", ["bytes", "tokenizer.json"])
def test_a_tokenizer_with_more_ids_than_the_vocabulary_is_refused_up_front_by_train_generate_and_serve(
        tmp_path, tokenizer):
    """plait train, generate and serve each refuse it before launching, in the same words, whatever the prompts
    (generate's 'hi' in 200 byte-level ids would fit)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from plait.models import Llama, LlamaConfig

    folder = tmp_path / "m"
    Llama(LlamaConfig(vocab_size=200, dim=16, n_layers=2, n_heads=2, max_seq_len=128)).save_pretrained(folder)
    source, size = "bytes (no tokenizer.json)", 256
    if tokenizer == "tokenizer.json":
        tok = Tokenizer(WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0"))
        tok.pre_tokenizer = Whitespace()
        tok.save(str(folder / "tokenizer.json"))
        source, size = "its tokenizer.json", 300
    needle = (f"error: --model {folder}: vocabulary 200 cannot hold the {size} ids of {source} (ids from 200 on would "
              "have no embedding row)\n")
    for command in (["train", "--dry-run"], ["generate", "--prompt", "hi"], ["serve"]):
        res = CliRunner().invoke(app, [*command, "--model", str(folder)])
        assert res.exit_code == 2 and res.output == needle, (command, res.output)


@pytest.mark.parametrize("top_k", ["1", "2"])
def test_top_k_with_a_mixtral_folder_is_refused_not_ignored(tmp_path, top_k):
    """--top-k shapes a preset's experts; a folder routes as its config.json says (top-1 was silently top-2, and a
    --top-k 2 equal to the folder's was refused for --experts 1, which was not typed)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 32, "vocab_size": 300, "num_hidden_layers": 1,
        "num_attention_heads": 4, "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2}))
    res = CliRunner().invoke(app, ["train", "--model", str(tmp_path), "--top-k", top_k, "--tp", "1", "--pp", "1",
                                   "--dry-run"])
    assert res.exit_code == 2 and res.output.startswith(
        f"error: --top-k {top_k}: it routes the experts --experts gives a preset (tiny, small); --model {tmp_path} "
        "routes as its config.json says (num_experts_per_tok); leave --top-k out"), res.output


def test_router_flags_reach_the_model_and_a_folder_s_experts_stay_dropless(tmp_path):
    """--capacity-factor and --aux-loss-coef set a preset's router (there were no such flags: capacity and the
    load-balancing weight could not be set from plait train); a folder takes the weight, and refuses capacity."""
    from plait.train.config import TrainConfig, model_config

    moe = model_config(TrainConfig.from_dict({"experts": 4, "top_k": 2, "capacity_factor": 1.25, "aux_loss_coef": 0}))
    assert (moe.n_experts, moe.top_k, moe.capacity_factor, moe.aux_loss_coef) == (4, 2, 1.25, 0.0)
    plain = model_config(TrainConfig.from_dict({"experts": 4, "top_k": 2}))
    assert (plain.capacity_factor, plain.aux_loss_coef) == (None, 0.01)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 32, "vocab_size": 300, "num_hidden_layers": 1,
        "num_attention_heads": 4, "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2}))
    assert model_config(TrainConfig.from_dict({"model": str(tmp_path)})).aux_loss_coef == 0.001  # its own
    assert model_config(TrainConfig.from_dict({"model": str(tmp_path), "aux_loss_coef": 0.02})).aux_loss_coef == 0.02
    res = CliRunner().invoke(app, ["train", "--model", str(tmp_path), "--capacity-factor", "1.5", "--tp", "1", "--pp",
                                   "1", "--dry-run"])
    assert res.exit_code == 2 and res.output.startswith(
        f"error: --capacity-factor 1.5: --model {tmp_path}'s experts route dropless, as transformers runs them"), \
        res.output
