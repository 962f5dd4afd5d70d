"""Sliding windows on some layers (Qwen2's and Qwen3's ``use_sliding_window`` / ``max_window_layers`` /
``layer_types``): which layers slide, read as transformers reads a config; the config's checks; the export's keys;
the planner's per-layer share; and a window as long as the keys attending without a mask."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import plait
from plait.errors import ConfigError
from plait.models import LlamaConfig, Qwen2, Qwen2Config
from plait.models.hf import config_from_hf
from plait.models.llama import Attention

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[dev])")
SHAPES = dict(vocab_size=61, hidden_size=32, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48)
S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize("family,fields", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=4)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=0)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=7)),  # the default max_window_layers, 28: no layer slides
    ("qwen2", dict(use_sliding_window=False, sliding_window=7, max_window_layers=2)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=5, layer_types=[S, F, S, S, F, F], max_window_layers=5)),
    ("qwen3", dict(use_sliding_window=True, layer_types=[F, S] * 3)),  # transformers' default window, 4096
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=9, max_window_layers=3)),  # its every layer slides
    ("qwen3_moe", dict(use_sliding_window=False, sliding_window=9)),
])
def test_the_layers_that_slide_are_those_transformers_slides(family, fields):
    """A config dict saved by transformers, read by plait: layer i's window is the one transformers' attention of
    layer i takes (its ``sliding_window`` where the config's ``layer_types`` say "sliding_attention"; Qwen3-MoE's
    every layer with ``use_sliding_window``), read from the dict both with transformers' ``layer_types`` and, as
    older folders are, without them."""
    name = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}[family]
    extra = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True) if family == "qwen3_moe" else {}
    theirs = getattr(transformers, name)(**SHAPES, **extra, **fields)
    types = getattr(theirs, "layer_types", None) or [S] * theirs.num_hidden_layers
    want = [theirs.sliding_window if t == S else None for t in types]
    hf = theirs.to_dict()
    older = {k: v for k, v in hf.items() if k != "layer_types" or "layer_types" in fields}
    for config in (hf, older):
        ours = config_from_hf(config)
        assert [ours.window_of(i) for i in range(ours.n_layers)] == want, config is hf


def test_a_layer_list_must_fit_the_model_and_its_window():
    base = dict(vocab_size=61, dim=32, n_layers=3, n_heads=4)
    with pytest.raises(ConfigError, match=r"layer_types: 2 entries; it needs one per layer \(n_layers=3\)"):
        LlamaConfig(**base, sliding_window=4, layer_types=(S, F))
    with pytest.raises(ConfigError, match="among them 'local'"):
        LlamaConfig(**base, sliding_window=4, layer_types=(S, F, "local"))
    with pytest.raises(ConfigError, match="names 'sliding_attention' layers but sliding_window=None"):
        LlamaConfig(**base, layer_types=(S, F, F))
    cfg = LlamaConfig(**base, sliding_window=4, layer_types=[F, S, F])  # a list (from JSON) is kept as a tuple
    assert cfg.layer_types == (F, S, F) and [cfg.window_of(i) for i in range(3)] == [None, 4, None]
    assert LlamaConfig(**json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_export_writes_the_windows_transformers_reads(tmp_path):
    """A Qwen2 with windows on layers 1 and 2 of 3 saved as a folder: transformers' config of it slides the same
    layers, and plait reads the folder back as the same config (``max_window_layers`` says the same where the
    sliding layers are the last ones; else ``layer_types`` alone does)."""
    for types, first in (((F, S, S), 1), ((S, F, S), 3)):
        cfg = Qwen2Config(vocab_size=61, dim=32, n_layers=3, n_heads=4, sliding_window=4, layer_types=types)
        Qwen2(cfg).save_pretrained(tmp_path / str(first))
        written = json.loads((tmp_path / str(first) / "config.json").read_text())
        assert (written["use_sliding_window"], written["max_window_layers"]) == (True, first)
        theirs = transformers.AutoConfig.from_pretrained(tmp_path / str(first))
        assert (list(theirs.layer_types), theirs.sliding_window) == (list(types), 4)
        assert plait.models.from_pretrained(tmp_path / str(first)).config == cfg


def _mask_seen(window: int | None, seq: int) -> torch.Tensor | None:
    """The mask a layer with ``window`` hands its core for ``seq`` tokens."""
    attention = Attention(LlamaConfig(vocab_size=61, dim=32, n_layers=1, n_heads=4, sliding_window=window))
    seen: list[torch.Tensor | None] = []
    core = attention.core
    attention.core = lambda q, k, v, mask, causal=True: seen.append(mask) or core(q, k, v, mask, causal)  # type: ignore[method-assign]
    attention(torch.randn(1, seq, 32))
    return seen[0]


def test_a_window_as_long_as_the_sequence_builds_no_mask():
    """A window that hides no key (the sequence fits in it) leaves SDPA's own causal path (no mask built, the flash
    backend's case); a shorter one hands the core its mask."""
    assert _mask_seen(8, 8) is None and _mask_seen(100, 8) is None and _mask_seen(None, 8) is None
    assert _mask_seen(7, 8) is not None


def test_the_planner_counts_the_window_on_the_layers_that_take_it(tmp_path):
    """A Qwen2 folder whose last 8 of 32 layers slide: ``window_layers`` 8; the attention core's time lies a
    quarter of the way from no window's to every layer's, at cp1 (the masked square) and under cp (the pairs the
    window keeps); a window as long as the sequence costs what none does."""
    from plait.plan import Cluster, Layout, Model

    seq, window = 32768, 4096
    folder = {**SHAPES, "model_type": "qwen2", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "max_position_embeddings": seq,
              "use_sliding_window": True, "sliding_window": window, "max_window_layers": 24}
    (tmp_path / "config.json").write_text(json.dumps(folder))
    part = Model.from_hf_config(tmp_path)
    assert (part.sliding_window, part.window_layers, part.window_layer_share) == (window, 8, 0.25)
    none, every = replace(part, sliding_window=None, window_layers=None), replace(part, window_layers=None)
    cluster = Cluster("h100-sxm", 8)
    for cp in (1, 4):
        layout = Layout(cp=cp, dp=8 // cp)
        f_none, f_part, f_every = (cluster.costs.blocks(m, layout, "bf16").layer.f_compute for m in (none, part, every))
        assert f_every != f_none and f_part - f_none == pytest.approx((f_every - f_none) / 4, rel=1e-9), cp
        spanning = cluster.costs.blocks(replace(every, sliding_window=seq), layout, "bf16").layer.f_compute
        assert spanning == pytest.approx(f_none, rel=1e-12), cp


def test_a_checkpoint_of_a_qwen2_folder_exports_its_windows(tmp_path):
    """``plait train`` on a Qwen2 folder whose layers 0 and 2 slide, saved and exported (``plait export``'s
    ``export_pretrained``): transformers reads the exported folder's windows on the same layers."""
    from plait.checkpoint.store import export_pretrained
    from plait.train import TrainConfig
    from plait.train.loop import build, save

    types = (S, F, S)
    torch.manual_seed(0)
    Qwen2(Qwen2Config(vocab_size=256, dim=32, n_layers=3, n_heads=4, max_seq_len=64, sliding_window=8,
                      layer_types=types)).save_pretrained(tmp_path / "qwen2")
    cfg = TrainConfig.from_dict(dict(model=str(tmp_path / "qwen2"), seq_len=64, batch_size=2, microbatches=1, steps=1,
                                     eval_every=0, sample_tokens=0, trace_every=0, max_data_mb=0.1, tp=1, pp=1, dp=1,
                                     checkpoint_dir=str(tmp_path / "ck"), cluster="none", async_checkpoint=False))
    with plait.init(1, 1, 1) as ctx:
        folder, _ = save(build(cfg, ctx), 1)
    export_pretrained(folder, tmp_path / "out")
    theirs = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert (tuple(theirs.layer_types), theirs.sliding_window) == (types, 8)
