"""Hugging Face import/export against ``transformers.LlamaForCausalLM`` (GQA, tied/untied, rope theta, norm eps)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait.errors import ConfigError
from plait.models import Llama, LlamaConfig

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[dev])")

CASES = {
    "gqa-untied": dict(num_key_value_heads=2, tie_word_embeddings=False, rope_theta=5000.0, rms_norm_eps=1e-6),
    "mha-tied": dict(num_key_value_heads=4, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5),
    "mqa-untied": dict(num_key_value_heads=1, tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5),
}


def _hf_model(**kw):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=96, max_position_embeddings=64, **kw)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_pretrained_and_save_pretrained_match_transformers(tmp_path, case):
    hf = _hf_model(**CASES[case])
    hf.save_pretrained(tmp_path / "hf")
    model = Llama.from_pretrained(tmp_path / "hf").eval()
    kw = CASES[case]
    assert model.config.n_kv_heads == kw["num_key_value_heads"] and model.config.rope_theta == kw["rope_theta"]
    assert model.config.norm_eps == kw["rms_norm_eps"] and model.config.tie_embeddings == kw["tie_word_embeddings"]
    x = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        ref = hf(x).logits
        ours = model(x)
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()
    model.save_pretrained(tmp_path / "out")
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        again = back(x).logits
    assert (again - ours).abs().max() <= 1e-5 * ours.abs().max()
    if kw["tie_word_embeddings"]:
        assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()


def test_plait_model_round_trip_and_kv_cache_greedy_matches_transformers(tmp_path):
    import plait

    torch.manual_seed(1)
    model = Llama(LlamaConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)).eval()
    model.save_pretrained(tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    prompt = [5, 17, 3, 88]
    ours = plait.generate(model, prompt, max_new_tokens=10)
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert ours == theirs[0, len(prompt):].tolist()


def test_unsupported_hf_config_is_config_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "vocab_size": 10,
                                                      "num_hidden_layers": 1, "num_attention_heads": 4,
                                                      "intermediate_size": 8, "attention_bias": True}))
    with pytest.raises(ConfigError, match="attention_bias"):
        Llama.from_pretrained(tmp_path)


def test_rope_frequencies_stay_float32_in_bf16():
    import torch

    from plait.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, max_seq_len=64, rope_theta=5e5))
    attn = model.to(torch.bfloat16).layers[0].self_attn
    expected = 1.0 / (5e5 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    assert attn.inv_freq().dtype == torch.float32
    assert torch.allclose(attn.inv_freq().double(), expected, rtol=1e-6)


def test_a_llama_trained_with_experts_exports_as_a_mixtral_folder(tmp_path):
    """plait train --experts N builds a Llama whose every layer is a dropless top-k MoE: a Llama folder cannot say
    so ('experts: a Hugging Face 'llama' folder cannot express it'), so plait export writes it as the Mixtral it
    is, and transformers' logits equal plait's."""
    from typer.testing import CliRunner

    from plait.cli.main import app

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, n_experts=4,
                      top_k=2)
    model = Llama(cfg).eval()
    save_as_checkpoint(model, tmp_path / "ckpt", {"model": "tiny"})
    res = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "mixtral"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        ours, hf = model(tokens), theirs(tokens).logits
    assert type(theirs).__name__ == "MixtralForCausalLM"
    assert ((ours - hf).norm() / hf.norm()).item() < 1e-5


def save_as_checkpoint(model: Llama, folder: Path, train: dict) -> None:
    """``model``'s float32 weights as a one-file plait checkpoint (``folder``/step_00000001) of a run of settings
    ``train``, as plait train saves one."""
    from safetensors.torch import save_file

    from plait.checkpoint.store import FORMAT, META

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    ckpt = folder / "step_00000001"
    ckpt.mkdir(parents=True)
    save_file(state, str(ckpt / "pp0-tp0-dp0.safetensors"))
    tensors = {k: {"shape": list(v.shape), "dtype": "float32", "shards": [
        {"file": "pp0-tp0-dp0.safetensors", "dim": None, "start": 0, "stop": v.shape[0] if v.dim() else 1}]}
        for k, v in state.items()}
    (ckpt / META).write_text(json.dumps({"format": FORMAT, "step": 1, "model": model.config.to_dict(),
                                         "family": "llama", "train": train, "tensors": tensors}))


@pytest.mark.parametrize("precision,flag,dtype,tol", [
    ("bf16", None, torch.bfloat16, 2e-2),  # the default: the dtype the run trained in
    ("fp32", None, torch.float32, 1e-5),
    ("bf16", "float32", torch.float32, 1e-5),  # a bf16 run's exact float32 masters
    ("bf16", "float16", torch.float16, 4e-3),
])
def test_export_writes_the_weights_in_the_dtype_the_run_trained_in_or_in_dtype(tmp_path, precision, flag, dtype, tol):
    """plait export wrote float32 whatever the run (a bf16 run's folder twice the size); it writes the run's dtype
    or --dtype's, config.json's torch_dtype says so, and transformers loads it so with logits near plait's."""
    from safetensors import safe_open
    from typer.testing import CliRunner

    from plait.cli.main import app

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)).eval()
    save_as_checkpoint(model, tmp_path / "ckpt", {"model": "tiny", "precision": precision})
    name = str(dtype).removeprefix("torch.")
    res = CliRunner().invoke(app, ["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"),
                                   *(["--dtype", flag] if flag else [])])
    assert res.exit_code == 0 and res.stdout.endswith(f"model.safetensors ({name} weights)\n"), res.output
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == name
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {dtype}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.dtype == dtype
    tokens = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        ours, hf = model(tokens), theirs(tokens).logits.float()
    assert ((ours - hf).norm() / ours.norm()).item() < tol


def test_export_names_the_dtypes_it_writes():
    from typer.testing import CliRunner

    from plait.cli.main import app

    res = CliRunner().invoke(app, ["export", "ckpt", "hf", "--dtype", "bf16"])
    assert res.exit_code == 2 and res.stderr == ("error: --dtype 'bf16': valid float32, bfloat16, float16 (or leave it "
                                                 "out: the dtype the run trained in)\n"), res.output


def _with_tokenizer_checkpoint(tmp_path: Path, extra: dict[str, dict]) -> LlamaConfig:
    """A checkpoint (tmp_path/with-tokenizer) of a model trained with the byte-pair tokenizer of tmp_path/bpe (its
    tokenizer.json, tokenizer_config.json and the ``extra`` JSON files), whose documents ended with token 5."""
    from data_util import bpe_folder
    from plait.tokenizers import fingerprint_file

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=400, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=32)
    bpe_folder(tmp_path / "bpe", 400)
    for name, values in extra.items():
        (tmp_path / "bpe" / name).write_text(json.dumps(values))
    save_as_checkpoint(Llama(cfg), tmp_path / "with-tokenizer", {"model": str(tmp_path / "bpe")})
    meta_file = tmp_path / "with-tokenizer" / "step_00000001" / "meta.json"
    meta = json.loads(meta_file.read_text())  # its documents ended with token 5: config.json's eos_token_id
    meta_file.write_text(json.dumps({**meta, "tokenizer": {"folder": str(tmp_path / "bpe"), "eos": 5,
                                                           "fingerprint": fingerprint_file(tmp_path / "bpe" /
                                                                                           "tokenizer.json")}}))
    return cfg


def test_export_replaces_its_earlier_export_and_refuses_other_folders_without_force(tmp_path, monkeypatch):
    """plait export wrote into any folder (., a downloaded model), and over an earlier export it left that one's
    tokenizer.json and generation_config.json beside the new weights, to be read with them: it replaces an earlier
    export (removing what the new one does not write, keeping the user's files) and refuses another non-empty
    folder, naming it, what it holds and --force, before writing anything."""
    from typer.testing import CliRunner

    from plait.cli.main import app

    cfg = _with_tokenizer_checkpoint(tmp_path, {"generation_config.json": {"eos_token_id": 3, "bos_token_id": 2}})
    save_as_checkpoint(Llama(LlamaConfig(**{**cfg.to_dict(), "vocab_size": 256})), tmp_path / "bytes",
                       {"model": "tiny"})
    monkeypatch.chdir(tmp_path)
    export = CliRunner().invoke
    assert export(app, ["export", "bytes", "fresh"]).exit_code == 0  # the byte-level model's own export
    first = export(app, ["export", "with-tokenizer", "hf"])
    assert first.exit_code == 0, first.output
    assert {"tokenizer.json", "generation_config.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 5
    (tmp_path / "hf" / "README.md").write_text("my notes")
    again = export(app, ["export", "bytes", "hf"])  # was: refused, 'OUT hf holds a tokenizer.json'
    assert again.exit_code == 0, again.output
    assert again.stdout.endswith("removed tokenizer.json, tokenizer_config.json, generation_config.json: the previous "
                                 "export's, which this model does not have\n"), again.stdout
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert (tmp_path / "hf" / "config.json").read_text() == (tmp_path / "fresh" / "config.json").read_text()
    assert "removed" not in export(app, ["export", "bytes", "hf"]).stdout  # nothing stale the second time

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    (tmp_path / "mine" / "config.json").write_text("{}")
    for out in ("mine", "."):
        res = export(app, ["export", "bytes", out])
        assert res.exit_code == 2 and res.stderr.startswith(f"error: OUT {out}: holds "), res.output
        assert "is not a folder plait export wrote" in res.stderr and "--force" in res.stderr, res.stderr
    assert "config.json, notes.txt, and is not" in export(app, ["export", "bytes", "mine"]).stderr
    assert (tmp_path / "mine" / "config.json").read_text() == "{}" and not (tmp_path / "model.safetensors").exists()
    forced = export(app, ["export", "bytes", "mine", "--force"])
    assert forced.exit_code == 0, forced.output
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mine").config.vocab_size == 256


def test_export_force_replaces_the_model_in_the_folder_instead_of_mixing_with_it(tmp_path, monkeypatch):
    """plait export --force into another model's folder (a downloaded one) kept that model's token ids in the new
    config.json (its eos_token_id 2, not the trained 5) and its generation_config.json, special_tokens_map.json and
    tokenizer.model beside the new weights and tokenizer, to be read with them. It removes the files an export
    writes, and other tokenizers' files, before writing, and says which; the folder's other files stay, and a
    folder holding other weights is refused before anything is removed."""
    from typer.testing import CliRunner

    from data_util import bpe_folder
    from plait.cli.main import app
    from plait.tokenizers import fingerprint_file

    _with_tokenizer_checkpoint(tmp_path, {})
    other = tmp_path / "downloaded"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)).save_pretrained(other)
    bpe_folder(other, 300)  # another tokenizer.json and tokenizer_config.json
    (other / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    (other / "tokenizer.model").write_bytes(b"a sentencepiece model")
    (other / "README.md").write_text("the model card")
    assert (other / "generation_config.json").is_file()  # transformers wrote the token ids there too
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["export", "with-tokenizer", "downloaded", "--force"])
    assert res.exit_code == 0, res.output
    assert res.stdout.endswith(
        "removed config.json, model.safetensors, tokenizer.json, tokenizer_config.json, special_tokens_map.json, "
        "generation_config.json, tokenizer.model before writing: the model downloaded held (--force); this one has "
        "no special_tokens_map.json, generation_config.json, tokenizer.model\n"), res.stdout
    assert sorted(p.name for p in other.iterdir()) == ["README.md", "config.json", "model.safetensors",
                                                       "tokenizer.json", "tokenizer_config.json"]
    hf = json.loads((other / "config.json").read_text())
    assert (hf["eos_token_id"], hf.get("bos_token_id"), hf.get("pad_token_id")) == (5, None, None)  # none of 1, 2, 0
    assert fingerprint_file(other / "tokenizer.json") == fingerprint_file(tmp_path / "bpe" / "tokenizer.json")
    assert transformers.AutoModelForCausalLM.from_pretrained(other).generation_config.eos_token_id == 5

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name, text in (("config.json", "{}"), ("model-00001-of-00002.safetensors", "shard"),
                       ("model.safetensors.index.json", '{"weight_map": {}}')):
        (sharded / name).write_text(text)
    res = CliRunner().invoke(app, ["export", "with-tokenizer", "sharded", "--force"])
    assert res.exit_code == 2 and "holds other weights (model-00001-of-00002.safetensors" in res.stderr, res.output
    assert (sharded / "config.json").read_text() == "{}"  # nothing removed
