"""A sliding window in plait plan: the MFU numerator (``timing.model_flops_per_step``) counts the attention a model
defines (a windowed layer's queries against the window's keys, not the whole sequence's), and a line of the plan says
on which layers the window is and how the cost model counts it."""

from dataclasses import replace

from plait.plan import Cluster, Model, Training, search
from plait.plan.timing import head_forward_flops, layer_forward_flops, model_flops_per_step

# Mistral-7B's shapes (a 4,096-token window on every layer) at 128k tokens
MISTRAL = Model(32, 4096, 32, 32000, 131072, glu=True, ffn_hidden=14336, n_kv_heads=8, sliding_window=4096)


def test_windowed_layers_count_the_windows_keys_and_the_others_the_sequences():
    tokens = 2 * MISTRAL.seq_len
    head = head_forward_flops(MISTRAL, tokens)
    every = model_flops_per_step(MISTRAL, 2)
    assert every == 3 * (32 * layer_forward_flops(MISTRAL, tokens, 4096) + head)
    half = replace(MISTRAL, window_layers=16)  # Qwen2's max_window_layers: the later 16 layers slide
    assert model_flops_per_step(half, 2) == 3 * (16 * layer_forward_flops(MISTRAL, tokens, 4096)
                                                 + 16 * layer_forward_flops(MISTRAL, tokens, 131072) + head)
    spans = replace(MISTRAL, seq_len=4096)  # a window as long as the sequence hides nothing
    assert model_flops_per_step(spans, 2) == 3 * (32 * layer_forward_flops(spans, 2 * 4096, 4096)
                                                  + head_forward_flops(spans, 2 * 4096))


def test_a_long_windowed_plan_stays_under_the_peak():
    """Counted over the whole sequence, a 4k window at 128k tokens gave 32 times its attention FLOPs and the best
    layout an MFU near 200%."""
    best = search(MISTRAL, Cluster("h100-sxm", 16, gpus_per_node=8), Training(16), top=3).best
    assert best and all(0.2 < e.mfu < 0.8 for e in best)


def test_the_plan_says_on_which_layers_the_window_is_and_how_it_is_counted():
    """plait plan of a windowed model said nothing of its window: now one line names the layers and, per cost model,
    how their attention is counted (a calibrated host does not time what the window saves); none where the window
    spans the sequence."""
    from calibrated_util import host_cluster, host_section
    from plait.plan import Layout, estimate, explain
    from plait.plan.explain import window_line

    qwen = replace(MISTRAL, window_layers=16)
    gpu = explain(search(qwen, Cluster("h100-sxm", 16, gpus_per_node=8), Training(16), top=3))
    said = [line for line in gpu if line.startswith("sliding window")]
    assert said == [gpu_line := said[0]] and "of 4,096 keys on 16 of 32 layers at 131,072 tokens" in gpu_line, gpu
    assert "6% of the causal ones" in gpu_line and "the MFU counts the window's keys" in gpu_line, gpu_line
    small = Model(2, 64, 4, 256, 256, glu=True, n_kv_heads=2, sliding_window=64)
    host = window_line(estimate(small, host_cluster(host_section(None)), Layout(), Training(2)))
    assert host.startswith("sliding window of 64 keys on 2 of 2 layers at 256 tokens: the calibrated host's model "
                           "times their attention as causal"), host
    assert window_line(estimate(replace(small, seq_len=64), host_cluster(host_section(None)), Layout(),
                                Training(2))) == ""
