"""ZeRO-3 as DeepSpeed v0.3.13 runs it (``Training.zero3_impl="deepspeed-0.3"`` and, with contiguous_gradients,
``"deepspeed-0.3-contiguous"``; ``plan.zero3_deepspeed``): the walk's seconds worked by hand, the gathers, all-reduces
and reduce-scatters of a small GPT counted by hand, the refusals, and plait's own ZeRO-3 left as it was."""

from __future__ import annotations

from dataclasses import replace

import pytest

from plait.errors import ConfigError
from plait.plan import timing
from plait.plan.cluster import Cluster
from plait.plan.config import Layout, Training
from plait.plan.estimate import estimate
from plait.plan.published import gpt, runs
from plait.plan.zero3_deepspeed import (
    Gather,
    Scatter,
    Use,
    exposed,
    persistent,
    persistent_gather,
    scatter_cost,
    trace,
    walk,
)


def _walk(uses, gather=0.4, reduce=0.0, f=1.0):
    one = gather if isinstance(gather, Gather) else Gather(gather)
    return walk(tuple(uses), {"f": f, "b": f}, lambda e: one, lambda e: reduce)


def test_each_fetch_waits_and_only_one_prefetch_overlaps():
    # a (gathered, 0.4 s exposed); b prefetched beside a's 1 s, waited for at b's fetch (max(1, 0.4)); c the same
    # beside b's; c's compute to the end: 0.4 + 1 + 1 + 1 = 3.4 s, three gathers
    done = _walk(Use(m, 600_000_000, 600_000_000, ("f", 1.0)) for m in "abc")
    assert done.seconds == pytest.approx(3.4) and done.gathers == 3


def test_a_gathers_zeros_views_and_copies_issue_on_the_path():
    # a, b, c as above, each gather now with 0.05 s of zeros, 0.1 s of views before its launch, its copies' issue
    # 0.3 s and everything done 0.4 s after the launch. a: zeros (nothing in flight), views, done: 0.55; b's
    # prefetch right after a's synchronize: zeros 0.05 and views 0.1 exposed, a's compute launched after the 0.3 s
    # issue: max(0.3 + 1, 0.4) = 1.3; c the same beside b's: 1.45; c's compute: 1. In all 0.55 + 2 x 1.45 + 1 = 4.45 s
    # (3.4 s without the zeros, the views and the issue)
    done = _walk((Use(m, 600_000_000, 600_000_000, ("f", 1.0)) for m in "abc"), gather=Gather(0.4, 0.1, 0.3, 0.05))
    assert done.seconds == pytest.approx(4.45) and done.gathers == 3


def test_max_live_parameters_stop_the_prefetch():
    # 1.1e9 elements gathered exceed stage3_max_live_parameters (1e9): nothing is prefetched, every gather is
    # exposed after the compute before it: 3 x (0.4 + 1) = 4.2 s
    done = _walk(Use(m, 1_100_000_000, 1_100_000_000, ("f", 1.0)) for m in "abc")
    assert done.seconds == pytest.approx(4.2) and done.gathers == 3


def test_a_prefetch_of_small_parameters_runs_them_one_after_another():
    # a gathered (0.4); the prefetch takes b, c, d (2e7 elements each, to reach the 5e7 bucket), each behind a
    # device-wide synchronize: b's and c's gathers exposed (0.8), d's beside a's compute (max(1, 0.4)); then b, c, d
    # compute with nothing to wait for (3): 0.4 + 0.8 + 1 + 3 = 5.2 s
    uses = [Use("a", 600_000_000, 600_000_000, ("f", 1.0))]
    uses += [Use(m, 20_000_000, 20_000_000, ("f", 1.0)) for m in "bcd"]
    done = _walk(uses)
    assert done.seconds == pytest.approx(5.2) and done.gathers == 4


def test_gradients_all_reduced_in_buckets_beside_the_compute():
    # backward uses with nothing to fetch: 3e8-element gradients, a 5e8 bucket flushed as the next one would
    # overflow it, the last after the backward: 3 all-reduces of 2 s one after another on the network, the three
    # 1 s computes beside them (nothing synchronizes until the end): max(3, 6) = 6 s
    uses = [Use("x", 0, 0, ("b", 1.0), grads=300_000_000) for _ in range(3)]
    done = _walk(uses, reduce=2.0)
    assert done.reductions == 3 and done.seconds == pytest.approx(6.0)


def test_a_small_gpt_gathers_per_parameter_and_again_for_the_recomputation():
    # GPT, 2 layers, h = 12288, tied embeddings: per layer 4 weights gathered for the forward, 4 for the
    # recomputation, 3 for the backward (the MLP's second weight is used again at once: kept); biases and norms
    # stay whole (under 1e5 elements); the tied word embedding once (held), the positions' table twice: 25 gathers.
    # Gradient buckets: every weight's fills one (each over 5e8 with the next), and the embedding's: 9 all-reduces
    m = gpt(2, 12288, 96)
    uses = trace(m, Layout(dp=64, zero=3, recompute="full"))
    done = walk(uses, {}, lambda e: Gather(1.0), lambda e: 1.0)
    assert (done.gathers, done.reductions) == (25, 9)
    assert done.seconds == pytest.approx(34.0)  # no compute to hide behind: every collective exposed


def test_contiguous_gradients_reduce_scatter_each_tensor_after_the_hosts_issue():
    # contiguous_gradients: x's backward (1 s) hands over two gradients, each reduce-scattered on its own: the host
    # issues its views and copies (0.3 s), the collective runs 0.5 s after that, one after the other on the network:
    # host 0.3 and 0.6, network 0.8 and 1.3. y's hook first waits for those (reduction_stream.synchronize: host 1.3),
    # then issues its two: host 1.6 and 1.9, network 2.1 and 2.6; y's compute (launched at 0.6, after x's hook) ends
    # at 2. The end: 2.6 s (2.3 s if the host did not wait for the reductions before y's), four reduce-scatters
    def scatter(issue: float) -> Scatter:
        return Scatter(0.5, issue)

    uses = [Use(m, 0, 0, ("b", 1.0), grads=2, grad_tensors=(1, 1)) for m in "xy"]
    done = walk(tuple(uses), {"b": 1.0}, lambda e: Gather(0.4), lambda e: 0.0, lambda e: scatter(0.3))
    assert done.seconds == pytest.approx(2.6) and done.reductions == 4
    # the compute a sub-module launches waits for the host: x's hook issues 2 x 0.8 s, so y's second of compute
    # starts at 1.6 and ends at 2.6 (the network is done at 1.8); 2.0 s if it ran as if the host were free
    uses = [Use("x", 0, 0, ("b", 1.0), grads=2, grad_tensors=(1, 1)), Use("y", 0, 0, ("b", 1.0))]
    done = walk(tuple(uses), {"b": 1.0}, lambda e: Gather(0.4), lambda e: 0.0, lambda e: scatter(0.8))
    assert done.seconds == pytest.approx(2.6) and done.reductions == 2


def test_the_hosts_wait_is_for_the_reductions_not_a_prefetched_gather():
    # p is gathered at its fetch (0.9 s), then q prefetched (0.9 s on the network) beside p's backward (1 s). p's
    # hook waits for the reduction stream only, empty since the fetch's device-wide synchronize: it issues at once
    # (0.3 s) and its reduce-scatter follows q's gather on the network: done at max(0.9, 0.3) + 0.5 = 1.4. q's fetch
    # waits for that (clock 0.9 + 1.4), then q's second: 3.3 s (3.6 s if the host waited for the gather too)
    uses = (Use("p", 600_000_000, 600_000_000, ("b", 1.0), grads=1, grad_tensors=(1,)),
            Use("q", 600_000_000, 600_000_000, ("b", 1.0)))
    done = walk(uses, {"b": 1.0}, lambda e: Gather(0.9), lambda e: 0.0, lambda e: Scatter(0.5, 0.3))
    assert done.seconds == pytest.approx(3.3) and (done.gathers, done.reductions) == (2, 1)


def test_contiguous_gradients_reduce_scatter_every_parameter_tensor():
    # GPT, 2 layers, tied embeddings, LayerNorm with biases: each layer's four weights and four biases and its two
    # norms' weights and biases (12 tensors), the final norm's two, the word embedding and the positions: 28
    # reduce-scatters, none of them all-reduces of buckets; the gathers as without contiguous_gradients (25)
    m = gpt(2, 12288, 96)
    uses = trace(m, Layout(dp=64, zero=3, recompute="full"))
    done = walk(uses, {}, lambda e: Gather(1.0), lambda e: 1.0, lambda e: Scatter(1.0))
    assert (done.gathers, done.reductions) == (25, 28)
    per_layer = [u for u in uses if u.grad_tensors and u.module.endswith("0")]
    assert sum(len(u.grad_tensors) for u in per_layer) == 12
    assert sum(sum(u.grad_tensors) for u in per_layer) == m.layer_params()


def test_one_gradients_reduce_scatter_as_the_list_call_runs_it():
    c = Cluster("a100-80gb", 1536, interconnect="ib-hdr")
    one = scatter_cost(c.costs, 10**6, 1536, 1536, 2)
    # W = 1,536 narrow views at 2.0 us and copies into the flat input issued at 10.1 us: 18.59 ms of host first
    assert one.issue == pytest.approx(1536 * 12.1e-6)
    # then on the device the bucket's div_ (2 MB read and written), the last copy's 1/1536 of that, the collective
    bw = c.gpu.memory_bandwidth
    assert one.done == pytest.approx(4e6 / bw * (1 + 1 / 1536) + c.costs.collective("reduce_scatter", 2e6, 1536, 1536))


def test_estimate_charges_the_contiguous_walk_and_no_end_of_step_reduction():
    m, c, lay = gpt(4, 12288, 96), Cluster("a100-80gb", 1536, interconnect="ib-hdr"), Layout(dp=1536, zero=3,
                                                                                               recompute="full")
    base = estimate(m, c, lay, Training(1536, recompute_head=False, grad_dtype="fp16", zero3_impl="deepspeed-0.3"))
    cont = estimate(m, c, lay, Training(1536, recompute_head=False, grad_dtype="fp16",
                                        zero3_impl="deepspeed-0.3-contiguous"))
    assert cont.time["dp_comm"] == 0.0 and cont.time["compute"] == base.time["compute"]
    assert cont.time["zero_comm"] != base.time["zero_comm"]


@pytest.mark.parametrize(("ranks", "micro_s"), [(4, 489.40e-6), (8, 971.47e-6)])
def test_the_list_all_gathers_copies_per_rank(ranks, micro_s):
    # GPT, 2 layers, h = 512, vocab 1024, tied: every gathered weight is used again within 1e9 elements, so kept: 10
    # gathers a micro-batch (the word embedding 2^19 elements and the positions 2^20, then per layer qkv 3 x 2^18,
    # proj 2^18, fc1 and fc2 2^20 each; 7,864,320 in all), all at the first hook: the top module's fetch, then the
    # other nine prefetched one after another (under the 5e7 bucket). Each issues W = ranks copies at 10.1 us, slower
    # than its gather (at most 2.1 MB over 8 NVLink ranks), so each is done W x 10.1 us after its launch plus its
    # last copy's bytes (its share of 4 bytes an element at 2.039 TB/s); each has W views at 2 us; the two zeros
    # nothing runs beside (the first and second gathers') write 2 bytes an element:
    #   4 ranks: 10 x 4 x 2 us + 10 x 40.4 us + 7,864,320 x 4 / 2.039e12 / 4 + 1,572,864 x 2 / 2.039e12 = 489.40 us
    #            (40 copies)
    #   8 ranks: 10 x 8 x 2 us + 10 x 80.8 us + 7,864,320 x 4 / 2.039e12 / 8 + 1,572,864 x 2 / 2.039e12 = 971.47 us
    #            (80 copies)
    # and the compute hides the one gradient all-reduce at the end (all under the 5e8 bucket)
    m = gpt(2, 512, 8, vocab=1024)
    c, lay = Cluster("a100-80gb", ranks, interconnect="ib-hdr"), Layout(dp=ranks, zero=3, recompute="full")
    assert walk(trace(m, lay), {}, lambda e: Gather(1.0), lambda e: 0.0).gathers == 10
    one = Training(ranks, recompute_head=False, grad_dtype="fp16", zero3_impl="deepspeed-0.3")  # one micro-batch
    step = estimate(m, c, lay, one).time["zero_comm"]
    assert step - persistent_gather(c.costs, m, lay) == pytest.approx(micro_s, rel=1e-4)


def test_the_persistent_parameters_are_the_tensors_under_the_threshold():
    # GPT, 2 layers, h = 512, vocab 1024: each layer's four biases (qkv 1,536, proj 512, fc1 2,048, fc2 512) and two
    # LayerNorms' weights and biases (512 each), then the final norm's; the weights (2.6e5 to 1e6), the word
    # embedding (524,288) and the positions (2048 x 512) are at or above 1e5
    layer = (1536, 512, 2048, 512, 512, 512, 512, 512)
    assert persistent(gpt(2, 512, 8, vocab=1024), Layout(dp=4, zero=3)) == (*layer, *layer, 512, 512)
    # Narayanan et al.'s models: 8 a layer and the final norm's 2 (every bias under 1e5 at h = 12,288 and 20,480)
    assert len(persistent(gpt(96, 12288, 96), Layout(dp=384, zero=3))) == 770
    assert len(persistent(gpt(105, 20480, 128), Layout(dp=640, zero=3))) == 842


@pytest.mark.parametrize(("ranks", "step_s"), [(4, 1231.007e-6), (8, 2280.204e-6), (1024, 162025.0e-6)])
def test_the_step_gathers_the_persistent_parameters_and_copies_them_back_rank_by_rank(ranks, step_s):
    # the same GPT: 18 persistent tensors, 14,336 elements. _allgather_params copies the rank's 18 partitions into
    # the flat buffer (18 x 10.1 us), makes W views (2.0 us each), gathers (its W copies issued at 10.1 us, slower
    # than the gather), then for each tensor issues a copy_ (10.1 us) after a loop turn (3.8 us) for every rank
    # whose slice starts inside it:
    #   4 ranks: every slice of every tensor (72 turns): 181.8 + 8 + 40.4 + 72 x 13.9 = 1,231.0 us (+ bytes)
    #   8 ranks: 144 turns: 181.8 + 16 + 80.8 + 144 x 13.9 = 2,280.2 us
    #   1,024 ranks: slices of 2, 1, 2, 1 and 1 elements (1,536, 512, 2,048, 512 and the norms' 512 over 1,024, padded
    #   up), so 768, 512, 1,024, 512 and 4 x 512 turns a layer and 2 x 512 for the final norm: 10,752 turns; 181.8 +
    #   2,048 + 10,342.4 + 10,752 x 13.9 = 162,025.0 us
    m, c, lay = gpt(2, 512, 8, vocab=1024), Cluster("a100-80gb", ranks, interconnect="ib-hdr"), Layout(dp=ranks, zero=3)
    assert persistent_gather(c.costs, m, lay) == pytest.approx(step_s, rel=1e-5)


def test_estimate_charges_the_persistent_gather_once_a_step():
    # two micro-batches: the walk twice, the persistent parameters' gather once
    m, c = gpt(2, 512, 8, vocab=1024), Cluster("a100-80gb", 8, interconnect="ib-hdr")
    lay, t = Layout(dp=8, zero=3, recompute="full"), _ds()
    e = estimate(m, c, lay, replace(t, global_batch=16))
    busiest = timing.rank_costs(c.costs, m, lay, t, 2)[0]
    walked = exposed(m, c, lay, t, busiest)
    assert e.time["zero_comm"] == pytest.approx(2 * walked + persistent_gather(c.costs, m, lay))


def _ds(**kw):
    return Training(64, recompute_head=False, grad_dtype="fp16", zero3_impl="deepspeed-0.3", **kw)


def test_estimate_charges_the_walk_and_no_end_of_step_reduction():
    m, c, lay = gpt(4, 12288, 96), Cluster("a100-80gb", 64, interconnect="ib-hdr"), Layout(dp=64, zero=3,
                                                                                           recompute="full")
    ds, own = estimate(m, c, lay, _ds()), estimate(m, c, lay, Training(64, recompute_head=False, grad_dtype="fp16"))
    assert ds.time["dp_comm"] == 0.0 and ds.time["zero_comm"] > own.time["zero_comm"]
    assert ds.time["compute"] == own.time["compute"] and ds.time["recompute"] == own.time["recompute"]


def test_refused_by_the_runtime_and_by_a_pipeline():
    with pytest.raises(ConfigError, match="zero3_impl"):
        Layout(dp=8, zero=3).to_parallel_config(Training(8, zero3_impl="deepspeed-0.3"))
    with pytest.raises(ConfigError, match="zero3_impl"):
        Training(8, zero3_impl="deepspeed")
    with pytest.raises(ConfigError, match="zero3_impl"):
        estimate(gpt(4, 1024, 16), Cluster("a100-80gb", 16), Layout(pp=2, dp=8, zero=3), _ds())
    Layout(dp=8, zero=3).to_parallel_config(Training(8))  # plait's own runs


def test_only_narayanans_zero3_rows_use_it_with_contiguous_gradients():
    flagged = [(r.label, r.training.zero3_impl) for r in runs() if r.training.zero3_impl != "plait"]
    assert len(flagged) == 6 and all("ZeRO-3" in x and impl == "deepspeed-0.3-contiguous" for x, impl in flagged)
