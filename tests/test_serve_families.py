"""Every model family through plait serve's engine and paged KV cache equals transformers' greedy ``generate``.

Each family's folder is made by ``transformers`` (checks_families.hf_model, with a sliding window of 16: on every
layer, or on the second of two for Qwen2 and Qwen3) and loaded as ``plait serve`` loads it. Prompts of 20 to 44
tokens and 30 new tokens reach well past the window, so it crosses block boundaries (blocks of 4 or 16); the requests
run together (continuous batching, prompts split into chunks), share a prefix longer than the window from the prefix
cache, and the pool is small enough that some are preempted and recomputed.
"""

from __future__ import annotations

import pytest
import torch

from checks_families import hf_model
from plait.generation.job import load_model
from plait.serve.engine import Engine
from plait.serve.kv import BlockAllocator
from plait.serve.metrics import Metrics
from plait.serve.runner import Runner
from plait.serve.scheduler import Scheduler
from plait.tokenizers import ByteTokenizer
from serve_util import run_waves

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e .[dev])")

WINDOW, NEW = 16, 30
#: family -> (config overrides, KV block size); context 96 holds 44 + 30 positions
CASES = {
    "mistral": (dict(sliding_window=WINDOW), 4),
    "mixtral": (dict(sliding_window=WINDOW), 16),
    # Qwen's window on the second layer only (max_window_layers, layer_types), Qwen3-MoE's on every layer
    "qwen2": (dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), 4),
    "qwen3": (dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"]),
              16),
    "qwen3_moe": (dict(use_sliding_window=True, sliding_window=WINDOW), 4),
}


def _prompts() -> tuple[list[list[int]], list[list[int]]]:
    """A first prompt, then prompts of different lengths: three share its first 24 tokens (> the window)."""
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 61, (24,), generator=g).tolist()
    tails = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (1, 9, 20, 3)]
    other = torch.randint(0, 61, (40,), generator=g).tolist()
    return [prefix + tails[0]], [prefix + tails[1], other, prefix + tails[2], prefix + tails[3]]


@pytest.mark.parametrize("family", sorted(CASES))
def test_serving_engine_equals_transformers_greedy_generate(tmp_path, family):
    extra, block = CASES[family]
    hf = hf_model(family, max_position_embeddings=96, num_hidden_layers=2, **extra)
    hf.save_pretrained(tmp_path / family)
    model = load_model(str(tmp_path / family))[0]
    assert getattr(model.config, "sliding_window", None) == extra.get("sliding_window")
    blocks = 2 * -(-(44 + NEW) // block)  # room for two of the four running at once: some are preempted
    sched = Scheduler(BlockAllocator(blocks, block, prefix_cache=True), max_batch=8, step_tokens=24)
    engine = Engine(Runner(model, blocks, block), sched, ByteTokenizer(), Metrics(), distributed=False)
    first, rest = _prompts()
    outs = run_waves(engine, [[(p, NEW, 0.0, 0) for p in first], [(p, NEW, 0.0, 0) for p in rest]])
    hf.generation_config.eos_token_id = None  # plait serve's requests here ignore no end token: none is set
    for prompt, events in zip(first + rest, outs, strict=True):
        x = torch.tensor([prompt])  # a mask of ones: generate would take the prompt's token 0 (pad_token_id) as padding
        with torch.no_grad():
            theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0)
        ours = [e["id"] for e in events if e["type"] == "token"]
        assert ours == theirs[0, len(prompt):].tolist(), (family, len(prompt))
    assert sched.cached_tokens >= 3 * 24 and sched.preemptions > 0 and sched.alloc.used == 0
