"""Planner model catalogue: exact parameter counts against published sizes, and HF config import."""

import json
import re
import subprocess
import sys

import pytest

from plait import ConfigError
from plait.plan import Model


@pytest.mark.parametrize(
    "name, total, active",
    [
        ("llama3-8b", 8.03e9, None),  # Meta: 8.03B
        ("llama3-70b", 70.55e9, None),  # 70.6B
        ("llama3-405b", 405.85e9, None),  # 405.9B
        ("gpt3-175b", 174.6e9, None),  # 175B; 174.6B with Megatron's padded vocabulary (Narayanan Table 2)
        ("mixtral-8x7b", 46.70e9, 12.88e9),  # Mistral: 46.7B total, 12.9B active
    ],
)
def test_preset_parameter_counts(name, total, active):
    m = Model.preset(name)
    assert m.n_params() == pytest.approx(total, rel=2e-3)
    if active:
        assert m.n_params(active=True) == pytest.approx(active, rel=2e-3)


def test_llama3_8b_count_by_hand():
    m = Model.preset("llama3-8b")
    attn = 2 * 4096 * 4096 + 2 * 4096 * 1024  # Q, O; K, V with 8 of 32 heads (GQA)
    mlp = 3 * 4096 * 14336  # gate, up, down
    layer = attn + mlp + 2 * 4096  # two RMSNorm weights
    total = 32 * layer + 2 * 128256 * 4096 + 4096  # untied embedding and head, final norm
    assert m.n_params() == total == 8_030_261_248


def test_gpt3_matches_narayanan_formula():
    # P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)) (Narayanan et al. 2021, §5.1)
    m = Model.preset("gpt3-175b")
    l, h, v, s = 96, 12288, 51200, 2048
    formula = 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
    assert m.n_params() == pytest.approx(formula, rel=1e-6)


def test_seq_len_override_and_unknown_preset():
    assert Model.preset("llama3-8b", seq_len=2048).seq_len == 2048
    with pytest.raises(ConfigError, match="llama3-8b"):
        Model.preset("llama-9000")


def test_invalid_shapes_name_the_parameter():
    with pytest.raises(ConfigError, match="n_heads"):
        Model(2, 100, 3, 10, 16)
    with pytest.raises(ConfigError, match="n_kv_heads"):
        Model(2, 128, 8, 10, 16, n_kv_heads=3)


def test_from_hf_config(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256,
           "max_position_embeddings": 131072, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = Model.from_hf_config(tmp_path / "config.json")
    assert m.n_params() == Model.preset("llama3-8b").n_params()
    assert m.seq_len == 8192  # capped default; override with seq_len=
    assert Model.from_hf_config(tmp_path, seq_len=4096).seq_len == 4096
    moe = dict(cfg, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)
    (tmp_path / "moe.json").write_text(json.dumps(moe))
    assert Model.from_hf_config(tmp_path / "moe.json").n_params() == Model.preset("mixtral-8x7b").n_params()
    with pytest.raises(ConfigError, match="config"):
        Model.from_hf_config(tmp_path / "missing.json")


def test_config_json_sizes_may_be_numpy_integers_never_bools():
    """A config dict built by code may hold numpy integers: plait.hf_config reads them as the same Python ints
    (the integer check ParallelOptimizer's counts use); a bool, which Python counts as 1, is refused by its key."""
    import numpy as np

    from plait.hf_config import llama_fields

    hf = {"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
          "intermediate_size": 64, "max_position_embeddings": 128}
    numpy_hf = {**hf, "vocab_size": np.int64(32), "num_hidden_layers": np.int32(2), "max_position_embeddings": 128.0}
    fields = llama_fields(numpy_hf)
    assert fields == llama_fields(hf)
    assert all(type(fields[k]) is int for k in ("vocab_size", "n_layers", "max_seq_len"))
    with pytest.raises(ConfigError, match=r"^num_hidden_layers = True: must be an integer$"):
        llama_fields({**hf, "num_hidden_layers": True})


def test_a_config_of_another_family_may_hold_numpy_integers_never_bools():
    """The shapes of a config outside plait's families (GPT-2 style) are read by plait.errors.is_integer as the
    families' are: numpy integers and whole floats are the same counts; a bool (Python's 1) is refused by its key."""
    import numpy as np

    from plait.plan.model import _from_hf_dict

    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100, "n_positions": 256}
    numpy_gpt2 = {**gpt2, "n_layer": np.int64(2), "n_head": np.int32(4), "n_positions": np.float32(256.0)}
    assert _from_hf_dict(numpy_gpt2, None, "gpt2") == _from_hf_dict(gpt2, None, "gpt2")
    with pytest.raises(ConfigError, match=r"^config.json: n_layer = True: must be an integer$"):
        _from_hf_dict({**gpt2, "n_layer": True}, None, "gpt2")
    with pytest.raises(ConfigError, match=r"^config.json: n_layer = 2.5: must be an integer$"):
        _from_hf_dict({**gpt2, "n_layer": 2.5}, None, "gpt2")


def test_plan_imports_no_torch():
    code = "import sys, plait.plan, plait.plan.validation; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_heads_wider_than_hidden_over_heads_are_counted_in_every_projection():
    """A head size given apart from hidden / heads (``head_size``: Qwen3's head_dim) widens the q and output
    projections to ``q_width``: the parameters, the layer's GEMMs on a GPU (``timing.layer_gemms``), their time at
    the matmul speed (``tp_comm.layer_gemm_seconds``) and the attention scores' work all follow it. The GEMMs'
    FLOPs are 2 per matmul weight a token uses, whatever the head size."""
    from plait.plan import Layout, get_gpu
    from plait.plan.gemm import gemm_speed
    from plait.plan.timing import layer_forward_flops, layer_gemms
    from plait.plan.tp_comm import layer_gemm_seconds

    wide = Model(4, 1024, 8, 1000, 256, 2048, 4, glu=True, head_size=256)  # q 2048 wide over hidden 1024
    assert (wide.head_dim, wide.q_width) == (256, 2048)
    assert Model(4, 1024, 8, 1000, 256, head_size=128) == Model(4, 1024, 8, 1000, 256)  # 128 is hidden / heads
    matmul = wide.layer_params() - wide.layer_norm_params()
    assert matmul == 1024 * 2048 * 2 + 2 * 1024 * 4 * 256 + 3 * 1024 * 2048
    layout, tokens = Layout(tp=2), 256
    gemms = sum(2 * m * n * k * count for m, n, k, count in layer_gemms(wide, layout))
    assert gemms == 2 * tokens * matmul / 2  # one of two TP ranks
    gpu = get_gpu("h100-sxm")
    assert sum(layer_gemm_seconds(gpu, wide, layout, tokens)) * gemm_speed(gpu) == pytest.approx(gemms)
    assert layer_forward_flops(wide, tokens, 256) == 2 * tokens * matmul + 4 * tokens * 256 * 2048


def test_qkv_biases_are_counted_and_replicated_with_their_kv_heads():
    """Qwen2's biases on q, k and v alone (``qkv_bias``): q + 2kv parameters a layer, sharded with their
    projections' columns over TP, except K's and V's where TP exceeds the KV heads, which every rank keeps whole as
    it keeps their weights (plait's ReplicatedHeadsLinear)."""
    from plait.plan import Layout
    from plait.plan.memory import rank_params
    from plait.plan.step_end import tp_partial_elements

    plain = Model(2, 64, 4, 256, 32, n_kv_heads=2, glu=True)
    biased = Model(2, 64, 4, 256, 32, n_kv_heads=2, glu=True, qkv_bias=True)
    assert biased.n_params() - plain.n_params() == 2 * (64 + 2 * 2 * 16)
    extra = rank_params(biased, Layout(tp=4), 2, False, False)[0] - rank_params(plain, Layout(tp=4), 2, False, False)[0]
    assert extra == 2 * (64 / 4 + 2 * 2 * 16)  # q's bias a quarter a rank, K's and V's whole
    # and their gradients, partial on each TP rank, are summed over TP with the weights'
    summed = tp_partial_elements(biased, Layout(tp=4), 2, False) - tp_partial_elements(plain, Layout(tp=4), 2, False)
    assert summed == 2 * 2 * 2 * 16


#: Qwen3-30B-A3B's config.json (its shapes)
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
             "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
             "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "sliding_window": None,
             "use_sliding_window": False}


def test_a_qwen3_moe_config_is_read_as_plait_builds_it(tmp_path):
    """Qwen3-MoE is a family plait runs: its experts are moe_intermediate_size wide (intermediate_size, 6144, is no
    expert's) and its heads head_dim wide, 30.5B parameters (3.3B active: Qwen3-30B-A3B's model card); dense layers
    among the experts' and gates plait's router does not give are refused by the reader plait's models share."""
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_MOE, "norm_topk_prob": True}))
    m = Model.from_hf_config(tmp_path)
    assert round(m.n_params() / 1e9, 1) == 30.5 and 3.3e9 <= m.n_params(active=True) < 3.4e9
    assert (m.ffn, m.head_dim, m.head_norms, m.n_experts, m.top_k) == (768, 128, ("q", "k"), 128, 8)
    neutral = {"use_sliding_window": False, "sliding_window": 4096, "layer_types": ["full_attention"] * 48}
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_MOE, "norm_topk_prob": True, **neutral}))
    assert Model.from_hf_config(tmp_path) == m
    for key, value, needle in [("decoder_sparse_step", 2, "decoder_sparse_step=2"),
                               ("mlp_only_layers", [0], "mlp_only_layers=[0]"),
                               ("norm_topk_prob", False, "norm_topk_prob=false with num_experts_per_tok=8")]:
        (tmp_path / "config.json").write_text(json.dumps({**QWEN3_MOE, "norm_topk_prob": True, key: value}))
        with pytest.raises(ConfigError, match=re.escape(needle)):
            Model.from_hf_config(tmp_path)


def test_a_config_of_another_family_is_read_by_its_shapes_or_refused_where_they_do_not_say_it(tmp_path):
    """A config of a model type plait does not run (Qwen2-MoE's shapes) is read by the shapes its keys give: its
    experts are moe_intermediate_size wide and its heads head_dim wide (Qwen3-30B-A3B's shapes: 30.5B parameters,
    none of the q/k norms of Qwen3's family). A key describing what Model does not (shared experts, dense layers
    among the experts', latent attention, a sliding window) is a ConfigError naming it, unless its value leaves the
    model as Model describes it."""
    other = {**QWEN3_MOE, "model_type": "qwen2_moe"}
    (tmp_path / "config.json").write_text(json.dumps(other))
    m = Model.from_hf_config(tmp_path)
    assert round(m.n_params() / 1e9, 1) == 30.5
    assert (m.ffn, m.head_dim, m.head_norms, m.n_experts, m.top_k) == (768, 128, (), 128, 8)
    neutral = {"use_sliding_window": False, "sliding_window": 4096, "layer_types": ["full_attention"] * 48}
    (tmp_path / "config.json").write_text(json.dumps({**other, **neutral}))
    assert Model.from_hf_config(tmp_path) == m
    for key, value in [("n_shared_experts", 1), ("shared_expert_intermediate_size", 5632), ("first_k_dense_replace", 3),
                       ("decoder_sparse_step", 2), ("mlp_only_layers", [0]), ("kv_lora_rank", 512),
                       ("layer_types", ["sliding_attention", "full_attention"]), ("use_sliding_window", True)]:
        (tmp_path / "config.json").write_text(json.dumps({**other, **neutral, key: value}))
        named = "sliding_window = 4096" if key == "use_sliding_window" else f"{key} = {value!r}"
        with pytest.raises(ConfigError, match=rf"config.json: {re.escape(named)}: .* which the planner does not "
                                              r"model .*remove the key from a copy of the file"):
            Model.from_hf_config(tmp_path)
