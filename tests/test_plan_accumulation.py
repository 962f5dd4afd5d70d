"""The weight gradients' accumulation by implementation (``Training.grad_accumulation``, plan.accumulation): the HBM
bytes each backward moves per parameter element, charged in every chunk's backward, and the configurations refused."""

import pytest

from plait.errors import ConfigError
from plait.plan import Cluster, Layout, Model, Training, estimate
from plait.plan.timing import chunk_costs
from profile_util import synthetic_profile

# 4 layers of hidden 1024 (MLP 4096, RMSNorm, no biases), vocab 1000, untied: a layer is 4h² + 2·4h² + 2h =
# 12,584,960 parameters, the embedding 1,024,000, the head 1,024,000 + a 1024 final norm: 52,388,864 in all.
MODEL = Model(4, 1024, 8, 1000, 1024)
LAYER, EMBEDDING, HEAD = 12_584_960, 1_024_000, 1_025_024
A100 = 2.039e12  # bytes/s


def _accumulation(cluster: Cluster, layout: Layout, name: str, microbatches: int) -> list[float]:
    """Seconds each chunk's backward spends beyond its blocks' (the accumulation)."""
    blocks = cluster.costs.blocks(MODEL, layout, "bf16")
    chunks = chunk_costs(cluster.costs, MODEL, layout, Training(1, grad_accumulation=name), microbatches)
    plain = [blocks.layer.b_compute * c.layers + (blocks.embedding.b_compute if i == 0 else 0.0)
             + (blocks.head.b_compute if i == len(chunks) - 1 else 0.0) for i, c in enumerate(chunks)]
    return [c.b_compute - p for c, p in zip(chunks, plain, strict=True)]


def test_each_pipeline_stage_accumulates_its_own_parameters_every_backward():
    """pp=2, 8 micro-batches: stage 0 holds 2 layers and the embedding (26,193,920), stage 1 2 layers and the head
    (26,194,944). Autograd into 16-bit grads adds 6 B on 7 of 8 backwards (5.25 B on average); DeepSpeed's bf16
    cast-and-add 18 B on every one; under fusion only the norms (2 x 2 x 1024) and the embedding or the final
    norm pay apex's 10 B. Worked by hand at the A100's 2.039 TB/s; the W pass of a split backward carries it too."""
    a100, layout = Cluster("a100-80gb", 4), Layout(pp=2, dp=2)
    stage0, stage1 = 2 * LAYER + EMBEDDING, 2 * LAYER + HEAD
    assert _accumulation(a100, layout, "autograd-16bit", 8) == pytest.approx(
        [5.25 * stage0 / A100, 5.25 * stage1 / A100], rel=1e-9)
    assert _accumulation(a100, layout, "deepspeed-bf16", 8)[1] == pytest.approx(18 * 26_194_944 / A100, rel=1e-9)
    assert _accumulation(a100, layout, "apex-distributed-adam-fused", 8) == pytest.approx(
        [10 * 1_028_096 / A100, 10 * 5120 / A100], rel=1e-9)
    zbh1 = Layout(pp=2, dp=2, schedule="zb-h1")
    blocks = a100.costs.blocks(MODEL, zbh1, "bf16")
    w = chunk_costs(a100.costs, MODEL, zbh1, Training(1, grad_accumulation="deepspeed-bf16"), 8)[1].w_compute
    assert w - 2 * blocks.layer.w_compute - blocks.head.w_compute == pytest.approx(18 * 26_194_944 / A100, rel=1e-9)


def test_sharded_accumulation_adds_into_the_rank_shard():
    """ZeRO-3 over 4 ranks, 2 micro-batches, all 52,388,864 parameters gathered: plait copies each bf16 gradient
    into an fp32 reduce-scatter input (6 B) and adds the shard from the second backward on (12 B x 1/2 x 1/4):
    7.5 B per parameter; FSDP1 with bf16 reduction 4 + 4 B, then 10 B + 12 B x 1/2 on a quarter: 12 B."""
    a100, layout = Cluster("a100-80gb", 4), Layout(dp=4, zero=3)
    n = 4 * LAYER + EMBEDDING + HEAD
    assert _accumulation(a100, layout, "plait", 2) == pytest.approx([7.5 * n / A100], rel=1e-9)
    assert _accumulation(a100, layout, "fsdp1-bf16", 2) == pytest.approx([12 * n / A100], rel=1e-9)


def test_the_step_pays_every_micro_batch_of_it():
    """One A100, 4 micro-batches: DeepSpeed's 18 B a backward against autograd's 6 B on 3 of 4 moves the step by
    4 x (18 - 4.5) x 52,388,864 B = 2.829 GB at 2.039 TB/s, 1.3874 ms, all of it in the compute part."""
    a100 = Cluster("a100-80gb", 1)
    ds = estimate(MODEL, a100, Layout(), Training(4, grad_accumulation="deepspeed-bf16"))
    torch = estimate(MODEL, a100, Layout(), Training(4, grad_accumulation="autograd-16bit"))
    assert ds.step_time_s - torch.step_time_s == pytest.approx(1.38744e-3, rel=1e-4)
    assert ds.time["compute"] - torch.time["compute"] == pytest.approx(1.38744e-3, rel=1e-4)


def test_plaits_runtime_bytes_follow_its_precision_and_zero_stage():
    """bf16 without ZeRO: the bucket node's add of the bf16 gradient into the fp32 buffer (10); ZeRO-1: the
    hook's add of the bf16 gradient (10); fp32: autograd's fp32 add (12). One A100, one micro-batch."""
    a100, n = Cluster("a100-80gb", 1), 4 * LAYER + EMBEDDING + HEAD
    one = Cluster("a100-80gb", 2)
    assert _accumulation(a100, Layout(), "plait", 1) == pytest.approx([10 * n / A100], rel=1e-9)
    assert _accumulation(one, Layout(dp=2, zero=1), "plait", 1) == pytest.approx([10 * n / A100], rel=1e-9)
    chunks = chunk_costs(a100.costs, MODEL, Layout(), Training(1, precision="fp32"))
    blocks = a100.costs.blocks(MODEL, Layout(), "fp32")
    plain = 4 * blocks.layer.b_compute + blocks.embedding.b_compute + blocks.head.b_compute
    assert chunks[0].b_compute - plain == pytest.approx(12 * n / A100, rel=1e-9)


def test_unknown_or_foreign_accumulations_are_refused():
    with pytest.raises(ConfigError, match="grad_accumulation='fused': not one of plait, autograd-16bit"):
        Training(4, grad_accumulation="fused")
    with pytest.raises(ConfigError, match="grad_accumulation: 'fsdp2-fp32' is planned but plait's runtime"):
        Layout(dp=2).to_parallel_config(Training(4, grad_accumulation="fsdp2-fp32"))
    assert Layout(dp=2).to_parallel_config(Training(4, masters="plait")).dp == 2


def test_a_calibrated_host_has_plaits_accumulation_in_its_timed_blocks():
    """``plait calibrate`` times each block's backward with its gradients accumulating: nothing more is charged,
    and another stack's accumulation is refused (the host times plait's own)."""
    host = Cluster.from_profile(synthetic_profile(), 2)
    assert host.costs.accumulation_time(1e9) == 0.0
    with pytest.raises(ConfigError, match="grad_accumulation: 'fsdp1-bf16' is costed on catalogue GPUs"):
        host.costs.accumulation_time(1e9, "fsdp1-bf16")
