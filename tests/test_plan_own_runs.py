"""``plait plan``'s plans of plait's own runs: the memory it plans for a model and layout is what ``plait train``
measures for them (``pm.memory_report()`` on the first step, the reference the train/predict tests use)."""

import json

import pytest
from typer.testing import CliRunner

from memory_util import MEMORY_KINDS, first_step_memory
from plait.cli.main import app
from profile_util import synthetic_profile

PLANNED = {"params": "weights", "grads": "grads", "optimizer": "optimizer", "activations_peak": "activations"}


def planned_memory(tmp_path, model: str, precision: str) -> dict:
    """``plait plan --model MODEL --cluster`` (one process of the test host's profile, the one
    ``first_step_memory`` predicts on) at 2 x 128 tokens: the memory of its layout without ZeRO, recomputation or
    micro-batching (tp1 pp1 dp1 mb2 norc z0, the run ``first_step_memory`` trains), by ``memory_report``'s kinds."""
    profile = synthetic_profile(counts=(1,)).save(tmp_path / "host.toml")
    r = CliRunner().invoke(app, ["plan", "--model", model, "--gpus", "1", "--cluster", str(profile), "--precision",
                                 precision, "--global-batch", "2", "--seq-len", "128", "--top", "50", "--json"])
    assert r.exit_code == 0, r.output
    plans = [e for e in json.loads(r.output)["best"]
             if (e["layout"]["zero"], e["layout"]["recompute"], e["layout"]["microbatch_size"]) == (0, "none", 2)]
    assert len(plans) == 1, [e["layout"] for e in json.loads(r.output)["best"]]
    memory = plans[0]["memory"]
    return {kind: memory[key] - (memory["working"] if key == "activations" else 0) for kind, key in PLANNED.items()}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_plait_plan_plans_the_memory_plait_train_measures(tmp_path, precision):
    """bf16 without ZeRO as plait.optim runs it: the float32 parameters are their own masters (4 + 4 + 8 B a
    parameter), not Megatron-LM's bf16 weights beside float32 masters (2 + 4 + 12 B), which only the published runs
    are planned with (``Training.masters``); each kind within 1% of the measurement, as ``plait train``'s own
    prediction."""
    measured, _ = first_step_memory(tmp_path, "tiny", precision=precision)
    planned = planned_memory(tmp_path, "tiny", precision)
    for kind in MEMORY_KINDS:
        assert planned[kind] == pytest.approx(measured[kind], rel=0.01), (kind, planned[kind], measured[kind])


def test_the_searched_batch_is_planned_with_plaits_masters_too():
    """Without --global-batch the batch is searched (``search_batch``), each batch tried with plait's masters: the
    best layout of tiny on one H100 (no ZeRO) holds 4 B of float32 weights and 8 B of moments a parameter in bf16."""
    from plait.plan import Model

    r = CliRunner().invoke(app, ["plan", "--model", "tiny", "--gpus", "1", "--gpu", "h100-sxm", "--json"])
    assert r.exit_code == 0, r.output
    best = json.loads(r.output)["best"][0]
    n = Model.preset("tiny").n_params()
    assert best["layout"]["zero"] == 0 and (best["memory"]["weights"], best["memory"]["optimizer"]) == (4 * n, 8 * n)


def qwen3_folder(path):
    """A tiny Qwen3 folder whose heads are wider than hidden / heads (head_dim 32, hidden 64 over 4 heads), as
    Qwen3's own configs give head_dim apart, with its per-head q/k norms."""
    import torch

    from plait.models import Qwen3, Qwen3Config

    torch.manual_seed(0)
    Qwen3(Qwen3Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                      max_seq_len=128)).save_pretrained(path)
    return path


def mistral_folder(path):
    """A tiny Mistral folder with a sliding window of 32 keys (of 128 tokens)."""
    import torch

    from plait.models.mistral import Mistral, MistralConfig

    torch.manual_seed(0)
    Mistral(MistralConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128,
                          sliding_window=32)).save_pretrained(path)
    return path


def qwen2_folder(path):
    """A tiny Qwen2 folder: biases on its q, k and v projections."""
    import torch

    from plait.models import Qwen2, Qwen2Config

    torch.manual_seed(0)
    Qwen2(Qwen2Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)).save_pretrained(
        path)
    return path


@pytest.mark.parametrize("folder", [qwen3_folder, mistral_folder, qwen2_folder], ids=["qwen3", "mistral", "qwen2"])
def test_plait_plan_of_a_folder_plans_what_plait_train_measures(tmp_path, folder):
    """``plait plan --model DIR`` reads a folder's config.json as plait builds the model (``plait.hf_config``):
    Qwen3's explicit head_dim (the q and output projections 64 x 128, not 64 x 64) and its q/k norms, Mistral's
    window (the mask each layer's attention keeps), Qwen2's q/k/v biases; each kind within 1% of what ``plait
    train --model DIR`` measures, the parameters exactly. The planner's model is the one ``plait train``'s
    prediction and ``--layout auto`` plan with."""
    from plait.cli.auto_layout import plan_model
    from plait.plan import Model
    from plait.train import TrainConfig

    path = folder(tmp_path / "model")
    measured, _ = first_step_memory(tmp_path, str(path), precision="fp32")
    planned = planned_memory(tmp_path, str(path), "fp32")
    for kind in MEMORY_KINDS:
        assert planned[kind] == pytest.approx(measured[kind], rel=0.01), (kind, planned[kind], measured[kind])
    assert planned["params"] == measured["params"]
    trained = plan_model(TrainConfig.from_dict(dict(model=str(path), seq_len=128, tp=1, pp=1, dp=1)))
    assert Model.from_hf_config(path, seq_len=128) == trained


def test_a_calibrated_host_plans_plait_trains_default_batch(tmp_path):
    """``plait plan --cluster`` without --global-batch searched a GPU cluster's batches (4-64M tokens: 4096 x 1024
    for small on 4 processes, a step of over an hour on a CPU host); it now plans plait train's default run (its
    batch, and its sequence unless --seq-len is given) and says so."""
    from plait.train.config import TrainConfig

    profile = synthetic_profile().save(tmp_path / "host.toml")
    base = ["plan", "--model", "small", "--gpus", "4", "--cluster", str(profile), "--top", "1"]
    for extra, seq, unset in (([], TrainConfig.seq_len, "; --global-batch / --seq-len to set)"),
                              (["--seq-len", "64"], 64, "; --global-batch to set)")):
        r = CliRunner().invoke(app, [*base, *extra, "--json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.output)
        assert out["global_batch"] == TrainConfig.batch_size, out["global_batch_note"]
        assert out["global_batch_note"] == (f"global batch {TrainConfig.batch_size} of {seq}-token sequences (plait "
                                            f"train's default, for a calibrated host{unset}"), out["global_batch_note"]
        title = CliRunner().invoke(app, [*base, *extra], env={"COLUMNS": "200"}).output
        assert f"small (5.9M, seq {seq}) on 4 × testhost:4p, 4/node; global batch 16, fp32" in title, title
        assert out["global_batch_note"] in title, title
    r = CliRunner().invoke(app, [*base, "--global-batch", "8", "--seq-len", "64", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["global_batch_note"] == "", r.output  # both given: no note
