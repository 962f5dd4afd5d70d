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
