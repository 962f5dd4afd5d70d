"""One number per quantity: the bubble, the parts of a step, the stage partition and the default batch."""

import re

import pytest
import torch
from typer.testing import CliRunner

from plait.cli.main import app
from plait.models import Llama, LlamaConfig
from plait.models.registry import family_of
from plait.pipeline.balance import partition_layers
from plait.pipeline.partition import build_chunks
from plait.plan import Cluster, Layout, Model, Training, estimate
from plait.plan.estimate import pipeline
from plait.plan.memory import stage_layers
from plait.plan.pipeline import profile
from plait.plan.search import search_batch
from plait.plan.stages import stages
from plait.train.config import PRESETS

H100_64 = Cluster("h100-sxm", 64)


def test_bubble_is_the_same_in_ranking_breakdown_and_schedule():
    # 100 Gb/s Ethernet between 4 nodes: the best has an interleaved pipeline, whose schedule shows the first 16 of
    # its 64 micro-batches (their own bubble is not the step's)
    r = CliRunner().invoke(app, ["plan", "--model", "llama3-70b", "--gpus", "32", "--gpu", "h100-sxm",
                                 "--interconnect", "eth-100", "--global-batch", "512", "--show-schedule", "--top", "3"])
    assert r.exit_code == 0, r.output
    ranked = re.search(r"│ 1 │ .*?│\s+[\d.]+ │\s+[\d.]+% │\s+\d+ │\s+([\d.]+)% │", r.output).group(1)
    share = re.search(r"│ pp_bubble\s+│\s+[\d.]+ │\s+([\d.]+)% │", r.output).group(1)
    shown = re.search(r"bubble of the whole step ([\d.]+)%", r.output).group(1)
    assert ranked == share == shown, (ranked, share, shown)


@pytest.mark.parametrize("layout", [Layout(tp=8, pp=2, dp=4), Layout(tp=4, pp=4, dp=4, sequence_parallel=True,
                                                                    recompute="selective", zero=2,
                                                                    schedule="zb-h1"),
                                    Layout(tp=4, pp=4, dp=4, virtual_stages=2, schedule="interleaved-1f1b",
                                           sequence_parallel=True, recompute="full", zero=1)])
def test_parts_add_up_to_the_step_and_bubble_is_idle_share(layout):
    m = Model.preset("llama3-70b")
    e = estimate(m, H100_64, layout, Training(512))
    assert sum(e.time.values()) == pytest.approx(e.step_time_s, rel=1e-12)
    assert min(e.time.values()) >= 0.0
    assert e.bubble_fraction == pytest.approx(e.time["pp_bubble"] / e.step_time_s)
    # the pipeline part is simulated with the exact per-chunk costs: extrapolating M changes nothing
    chunks, pipe = pipeline(m, H100_64, layout, Training(512))
    exact = profile(layout.schedule, layout.pp, e.microbatches, layout.virtual_stages, [c.forward for c in chunks],
                    [c.backward for c in chunks], [c.weight for c in chunks] if layout.schedule == "zb-h1" else None,
                    chunks[0].p2p, exact=True)
    assert pipe.makespan == pytest.approx(exact.makespan, rel=1e-9)
    assert e.time["pp_bubble"] == pytest.approx(exact.idle, rel=1e-9)


def _runtime_counts(model: Llama, chunks: int) -> list[int]:
    """What the pipeline runtime cuts: the model family's costs and the partition call of build_chunks."""
    costs = family_of(model).layer_costs(model)
    return partition_layers(model.config.n_layers, chunks, "balanced", costs.layers, costs.first, costs.last)


def test_planner_and_runtime_cut_the_same_layers():
    m = Model.preset("llama3-70b")
    big = Llama.__new__(Llama)  # the 70B shapes without allocating it: the runtime costs it from its config
    torch.nn.Module.__init__(big)
    big.config = LlamaConfig(vocab_size=m.vocab, dim=m.hidden, n_layers=m.n_layers, n_heads=m.n_heads,
                             n_kv_heads=m.kv_heads, ffn_dim=m.ffn, max_seq_len=m.seq_len)
    assert stage_layers(m, 4) == (19, 21, 21, 19)  # the last rank also holds the head
    assert _runtime_counts(big, 4) == [19, 21, 21, 19]
    for pp, v, sched in ((2, 1, "1f1b"), (4, 2, "interleaved-1f1b"), (8, 2, "zbv")):
        assert list(stages(m, pp, v, sched).chunk_layers) == _runtime_counts(big, pp * v)
    for name, preset in PRESETS.items():  # plait train's own presets (balanced for their max_seq_len)
        model = Llama(LlamaConfig(**preset))
        small = Model.preset(name, seq_len=64)
        for k in (1, 2, 3, 4):
            family = family_of(model)
            built = build_chunks(family.blocks(model), family.layer_costs(model), k, "balanced")
            counts = [sum(n.startswith("layers.") for n in c.names) for c in built]
            assert list(stages(small, k).chunk_layers) == counts, (name, k)


def test_default_batch_gives_a_small_bubble_and_says_so():
    choice = search_batch(Model.preset("llama3-405b"), Cluster("h100-sxm", 8192), top=1)
    best = choice.result.best[0]
    assert best.bubble_fraction < 0.10
    assert best.training.global_batch == choice.global_batch
    assert f"{choice.global_batch} sequences" in choice.reason and "bubble under 10%" in choice.reason
