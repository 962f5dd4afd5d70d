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
from plait.models.window import every_layer_window
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
    every = every_layer_window(model.config.sliding_window, model.config.layer_types)  # as plait serve takes it
    # room for two of the four running at once (a sequence holds its window's blocks at most where every layer has
    # one): without windows some are preempted
    blocks = 2 * (-(-(44 + NEW) // block) if every is None else -(-(2 * every - 1) // block) + 1)
    sched = Scheduler(BlockAllocator(blocks, block, prefix_cache=True), max_batch=8, step_tokens=24, window=every)
    engine = Engine(Runner(model, blocks, block), sched, ByteTokenizer(), Metrics(), distributed=False)
    first, rest = _prompts()
    held = _watch_blocks(sched)
    outs = run_waves(engine, [[(p, NEW, 0.0, 0) for p in first], [(p, NEW, 0.0, 0) for p in rest]])
    hf.generation_config.eos_token_id = None  # plait serve's requests here ignore no end token: none is set
    for prompt, events in zip(first + rest, outs, strict=True):
        x = torch.tensor([prompt])  # a mask of ones: generate would take the prompt's token 0 (pad_token_id) as padding
        with torch.no_grad():
            theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0)
        ours = [e["id"] for e in events if e["type"] == "token"]
        assert ours == theirs[0, len(prompt):].tolist(), (family, len(prompt))
    # the windows' small pool evicts cached prefixes sooner: one request at least still starts from one
    assert sched.cached_tokens >= (3 if every is None else 1) * 24 and sched.alloc.used == 0
    assert sched.preemptions > 0 or every is not None  # preempted with windows: test_serve_unit.py
    # a window on every layer: blocks before it are freed as a sequence runs, so none holds more than the window's
    # blocks; a full-attention layer (Qwen2's, Qwen3's first) keeps every block
    assert (sched.window_freed > 0 and max(held) <= sched.window_blocks) if every else sched.window_freed == 0
    assert (every is None) == (family in ("qwen2", "qwen3")), every


def _watch_blocks(sched: Scheduler) -> list[int]:
    """The most blocks one sequence's table held after each step (the entries it let go of not counted)."""
    held: list[int] = [0]
    computed = sched.computed

    def watched(seq) -> None:
        computed(seq)
        held.append(sum(b != sched.alloc.hole for b in seq.table))

    sched.computed = watched  # type: ignore[method-assign]
    return held
