"""Model families on one device: Hugging Face import/export against transformers, the sliding window in training
and in both KV caches, the adapter seam, and what a folder plait cannot run says."""

from __future__ import annotations

import json
import re

import pytest
import torch

import plait
from checks_families import FAMILIES, hf_model, tokens
from plait.errors import ConfigError
from plait.models import Mistral, MistralConfig, Mixtral, Qwen2, Qwen3, Qwen3Moe
from plait.models.registry import families, family_of

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[dev])")
CLASSES = {"mistral": Mistral, "qwen2": Qwen2, "qwen3": Qwen3, "mixtral": Mixtral, "qwen3_moe": Qwen3Moe}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_export_and_kv_cache_decoding_match_transformers(tmp_path, family):
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    model = plait.models.from_pretrained(tmp_path / "hf").eval()
    assert type(model) is CLASSES[family] and family_of(model).name == family
    x = tokens()[0]
    with torch.no_grad():
        ref = hf(x).logits
        ours = model(x)
    assert (ours - ref).abs().max() <= 1e-5
    model.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == family
    back = type(hf).from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (back(x).logits - ours).abs().max() <= 1e-5
    prompt = [5, 17, 3, 40, 22]  # longer than Mistral's window of 3: decoding must drop the oldest keys
    greedy = plait.generate(model, prompt, max_new_tokens=8)
    hf.generation_config.eos_token_id = None  # plait generates exactly max_new_tokens
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert greedy == theirs[0, len(prompt):].tolist()


def _mistral(window: int | None) -> Mistral:
    torch.manual_seed(0)
    return Mistral(MistralConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                                 sliding_window=window)).eval()


def test_sliding_window_changes_attention_only_beyond_the_window():
    x = tokens()[0]  # 8 positions
    with torch.no_grad():
        full, windowed = _mistral(None)(x), _mistral(3)(x)
    assert torch.equal(full[:, :3], windowed[:, :3])  # the first 3 positions see no more than 3 keys anyway
    assert (full[:, 3:] - windowed[:, 3:]).abs().max() > 1e-3


def test_sliding_window_in_the_paged_cache_of_serving():
    """plait serve's paged cache (rows at different positions, blocks of 4) honours the window like plait generate."""
    from plait.generation import Sampling
    from plait.serve.runner import Row, Runner, Step
    from plait.serve.sampling import Params

    model = _mistral(3)
    prompts = {0: [5, 17, 3, 40, 22], 1: [9, 2]}
    tables = {0: [0, 1, 2], 1: [5, 4, 3]}  # 12 positions each
    runner = Runner(model, num_blocks=6, block_size=4)
    first = runner.execute(Step(new=[(r, Params(Sampling(6))) for r in prompts],
                                rows=[Row(r, p, 0, tables[r], True) for r, p in prompts.items()]))
    out = {r: [o[0]] for r, o in zip(prompts, first, strict=True)}
    for _ in range(5):
        rows = [Row(r, [out[r][-1]], len(prompts[r]) + len(out[r]) - 1, tables[r], True) for r in prompts]
        for r, o in zip(prompts, runner.execute(Step(rows=rows)), strict=True):
            out[r].append(o[0])
    for r, prompt in prompts.items():
        assert out[r] == plait.generate(model, prompt, max_new_tokens=6), r


def test_every_family_has_an_adapter_and_the_registry_finds_it():
    names = {f.name for f in families()}
    assert {"sequential", "llama", "mistral", "qwen2", "qwen3", "mixtral"} <= names
    assert family_of(torch.nn.Sequential(torch.nn.Linear(2, 2))).name == "sequential"
    with pytest.raises(ConfigError, match="not a model plait can parallelize"):
        family_of(torch.nn.Linear(2, 2))


def test_the_registry_lists_every_family_module_and_nothing_else():
    """The explicit registry (plait.models.registry.MODEL_TYPES) names every plait.models module that defines a
    FAMILY, under that family's model_type: a new family cannot be left out of it."""
    import importlib
    import pkgutil

    import plait.models as pkg
    from plait.models.registry import MODEL_TYPES, family_for_type

    defined = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"plait.models.{info.name}")
        if hasattr(module, "FAMILY"):
            defined[module.FAMILY.model_type] = module.__name__
    assert defined == MODEL_TYPES
    assert all(family_for_type(t).model_type == t for t in MODEL_TYPES)


def _folder(tmp_path, **hf):
    base = {"model_type": "llama", "hidden_size": 32, "vocab_size": 61, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 48}
    (tmp_path / "config.json").write_text(json.dumps({**base, **hf}))
    return tmp_path


@pytest.mark.parametrize("hf,needle", [
    ({"model_type": "gpt2"}, "supported model types: llama, mistral, mixtral, qwen2, qwen3, qwen3_moe"),
    ({"model_type": "qwen2", "layer_types": ["sliding_attention"]}, "sliding_attention.* use_sliding_window = false"),
    ({"model_type": "qwen3", "use_sliding_window": True, "layer_types": ["full_attention"] * 2},
     "layer_types = .*num_hidden_layers = 1"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
    ({"model_type": "mixtral", "router_jitter_noise": 0.1}, "router_jitter_noise"),
    ({"model_type": "mixtral", "num_experts_per_tok": 1}, "top_k"),
    ({"model_type": "qwen3_moe", "num_experts_per_tok": 2}, "norm_topk_prob=false with num_experts_per_tok=2: plait "
                                                           "renormalises .* valid: norm_topk_prob=true"),
    ({"model_type": "qwen3_moe", "num_experts_per_tok": 1, "norm_topk_prob": True}, "valid: norm_topk_prob=false"),
    ({"model_type": "qwen3_moe", "norm_topk_prob": True, "mlp_only_layers": [0]}, "mlp_only_layers=.0.: plait runs"),
    ({"model_type": "qwen3_moe", "norm_topk_prob": True, "decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"model_type": "mistral", "hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_folder_is_config_error(tmp_path, hf, needle):
    with pytest.raises(ConfigError, match=needle):
        plait.models.from_pretrained(_folder(tmp_path, **hf))


def test_a_family_refuses_to_save_what_its_format_cannot_hold(tmp_path):
    model = plait.models.Llama(plait.models.LlamaConfig(vocab_size=61, dim=32, n_layers=1, n_heads=4,
                                                        qk_norm=True))
    with pytest.raises(ConfigError, match="qk_norm.*qwen3"):
        model.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_cli_generate_and_serve_take_any_family_folder(tmp_path):
    """`plait generate --model DIR` on a Qwen3 folder (one process, in this one); an unknown model_type stops
    `plait train`, `generate` and `serve` before anything launches, listing the supported types."""
    from typer.testing import CliRunner

    from plait.cli.main import app
    from plait.models import Qwen3Config

    torch.manual_seed(0)
    Qwen3(Qwen3Config(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)).save_pretrained(
        tmp_path / "qwen3")
    res = CliRunner().invoke(app, ["generate", "--model", str(tmp_path / "qwen3"), "--prompt", "def ",
                                   "--max-new-tokens", "4"])
    assert res.exit_code == 0 and res.output.startswith("def "), res.output
    (tmp_path / "gpt2").mkdir()
    bad = _folder(tmp_path / "gpt2", model_type="gpt2")
    for command in (["train", "--nproc", "4"], ["generate"], ["serve"]):
        out = CliRunner().invoke(app, [*command, "--model", str(bad)])
        supported = "supported model types: llama, mistral, mixtral, qwen2, qwen3, qwen3_moe"
        assert out.exit_code == 2 and supported in out.output, (command, out.output)


def test_every_registered_family_s_folders_are_read_by_the_one_reader():
    """plait.hf_config, which plait's models and the planner both read a config.json with, knows the fields of
    every family the registry builds, and of no other."""
    from plait.hf_config import FAMILY_FIELDS
    from plait.models.registry import MODEL_TYPES

    assert sorted(FAMILY_FIELDS) == sorted(MODEL_TYPES)


def test_the_help_of_every_command_that_reads_a_model_folder_names_every_family():
    """`plait train`, `generate` and `serve --help` list the model types their --model takes: every registered
    one (a family added to the registry is named in each command's help too)."""
    from typer.testing import CliRunner

    from plait.cli.main import app
    from plait.models.registry import MODEL_TYPES

    for command in ("train", "generate", "serve"):
        shown = " ".join(CliRunner().invoke(app, [command, "--help"]).output.split())
        missing = [t for t in MODEL_TYPES if not re.search(rf"\b{t}\b", shown)]
        assert not missing, (command, missing)
