"""plait serve with a sliding window on every layer: the blocks a sequence has moved past are freed as it runs, so a
generation longer than the pool holds O(window) blocks, preemption and release count the freed entries right, and
the tokens stay plait.generate's."""

from __future__ import annotations

import torch

from plait.generation.decode import Sampling, generate_ids
from plait.models import Mistral, MistralConfig
from plait.serve.engine import Engine
from plait.serve.kv import BlockAllocator
from plait.serve.metrics import Metrics
from plait.serve.runner import Runner
from plait.serve.sampling import Params
from plait.serve.scheduler import Scheduler, Seq
from plait.tokenizers import ByteTokenizer
from serve_util import run_waves

WINDOW, BLOCK = 6, 4


def _held(sched: Scheduler, seq: Seq) -> int:
    return sum(b != sched.alloc.hole for b in seq.table)


def _run(sched: Scheduler, seqs: list[Seq], steps: int) -> int:
    """Feed the scheduled tokens ``steps`` times (a new token after each sample); the most blocks one held."""
    most = 0
    for _ in range(steps):
        for seq, n in sched.schedule():
            seq.computed += n
            if seq.computed == seq.length:
                seq.out.append(0)
            sched.computed(seq)
            most = max(most, _held(sched, seq))
        assert sched.alloc.used + sched.alloc.available == sched.alloc.num_blocks
    return most


def test_a_long_generation_holds_its_window_and_frees_the_rest():
    """A prompt of 20 and 40 new tokens (15 blocks of 4) in a pool of 8: fed at most W = 6 tokens a step, the
    sequence never holds more than ``window_blocks`` (4), frees the blocks its window has left, and runs to the end
    without preemption; ended, the pool is whole again."""
    sched = Scheduler(BlockAllocator(8, BLOCK), max_batch=2, window=WINDOW)
    seq = Seq(1, list(range(20)), Params(Sampling(40)))
    sched.add(seq)
    assert [n for _s, n in sched.schedule()] == [WINDOW]  # the first chunk: W tokens, not the whole prompt
    seq.computed = WINDOW
    sched.computed(seq)
    assert sched.window_freed == 0  # the next query (position 6) sees positions 1-6: block 0 (0-3) is kept
    assert [n for _s, n in sched.schedule()] == [WINDOW]
    seq.computed = 2 * WINDOW
    sched.computed(seq)
    assert seq.table[:2] == [sched.alloc.hole, 1] and sched.window_freed == 1  # position 12 sees 7-12
    most = _run(sched, [seq], 60)
    assert len(seq.out) >= 40 and most <= sched.window_blocks == 4 and sched.preemptions == 0
    assert sched.window_freed == len(seq.table) - _held(sched, seq)
    sched.remove(seq)
    assert sched.alloc.used == 0 and sched.alloc.available == 8


def test_preemption_releases_only_the_blocks_a_table_still_holds():
    """Two sequences in a pool of 5 (each holds up to 3 blocks decoding): the one admitted last is preempted, its
    table (holes and all) released once, and it is recomputed from 0 later; the pool's count holds at every step."""
    sched = Scheduler(BlockAllocator(5, BLOCK), max_batch=2, step_tokens=8, window=WINDOW)
    a, b = Seq(1, [1, 2], Params(Sampling(30))), Seq(2, [3, 4], Params(Sampling(30)))  # admitted for a block each
    sched.add(a)
    sched.add(b)
    _run(sched, [a, b], 40)
    assert sched.preemptions > 0 and sched.window_freed > 0
    for seq in (a, b):
        sched.remove(seq)
    assert sched.alloc.used == 0 and sched.alloc.available == 5 and not sched.alloc.refs


def test_engine_with_a_pool_smaller_than_its_generations_equals_generate():
    """A Mistral (window 6 on both layers) serving generations of 14-20 + 40 tokens from a pool of 12 blocks of 4
    (48 positions, less than one generation): each request's tokens equal plait.generate's, blocks are freed as
    they leave the window, and /metrics counts them."""
    torch.manual_seed(0)
    model = Mistral(MistralConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96,
                                  sliding_window=WINDOW)).eval()
    sched = Scheduler(BlockAllocator(12, BLOCK, prefix_cache=True), max_batch=4, step_tokens=8, window=WINDOW)
    engine = Engine(Runner(model, 12, BLOCK), sched, ByteTokenizer(), Metrics(), distributed=False)
    jobs = [(list(range(3 + i, 17 + 2 * i)), 40, 0.0 if i % 2 else 0.9, i) for i in range(4)]
    for (prompt, n, temperature, seed), events in zip(jobs, run_waves(engine, [jobs]), strict=True):
        assert [e["id"] for e in events if e["type"] == "token"] == generate_ids(
            model, [prompt], Sampling(n, temperature, 0, seed))[0]
    assert sched.window_freed > 4 * 10 and sched.alloc.used == 0
    assert f"plait_kv_window_freed_blocks_total {sched.window_freed}" in engine.metrics.render()


def test_plait_serve_frees_blocks_only_for_a_model_windowed_on_every_layer():
    """``plait serve``'s scheduler (``serve.job.scheduler``) takes the model's window when every layer has it
    (Mistral), and none when a layer attends to every key (Qwen2's first layer here): the pool's blocks hold every
    layer's keys."""
    from plait.models import Qwen2Config
    from plait.serve.job import scheduler

    payload = dict(kv_block=BLOCK, prefix_cache=True, max_batch=4, step_tokens=8, kv_reserve=False)
    mistral = MistralConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, sliding_window=WINDOW)
    qwen2 = Qwen2Config(vocab_size=256, dim=32, n_layers=2, n_heads=4, sliding_window=WINDOW,
                        layer_types=("full_attention", "sliding_attention"))
    assert scheduler(payload, mistral, 12).window == WINDOW and scheduler(payload, qwen2, 12).window is None
