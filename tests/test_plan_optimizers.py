"""The optimizer step by implementation (``Training.optimizer``, plan.optimizers): the HBM bytes each stack's step
and gradient clipping move per parameter, at the GPU's memory bandwidth, and the configurations refused."""

import pytest

from plait.errors import ConfigError
from plait.plan import Cluster, Layout, Model, Training, estimate
from plait.plan.memory import max_rank_params
from plait.plan.step_end import optimizer_time, publish_time

PARAMS = 1e9  # parameters on the GPU


@pytest.mark.parametrize(("optimizer", "ms"), [
    ("torch-fused-adamw", 9.552),  # 4 B fused float64 norm + 28 B fused AdamW = 32 B at 3.35 TB/s
    ("megatron-fp16", 15.522),  # 6 + 8 + 4 + 28 + 6 = 52 B
    ("megatron-core-bf16", 13.134),  # 6 + 4 + 28 + 6 = 44 B
    ("deepspeed-zero-fp16", 23.881),  # 10 + 18 + 10 + 8 + 28 + 6 = 80 B
    ("composer-decoupled-adamw", 27.463),  # 80 B of separate element-wise ops + FSDP's 12 B clip = 92 B
    ("torch-foreach-adamw", 27.463),  # 80 B of foreach ops + clip_grad_norm_'s 12 B = 92 B
])
def test_one_gpu_step_is_the_implementations_bytes_at_hbm_bandwidth(optimizer, ms):
    """A billion parameters on one H100 (3.35 TB/s): bytes per parameter x 1e9 / 3.35e12, worked by hand."""
    h100 = Cluster("h100-sxm", 1)
    assert optimizer_time(h100, Layout(), PARAMS, 8, optimizer) == pytest.approx(ms * 1e-3, rel=1e-4)


def test_zero_divides_the_owned_bytes_not_the_per_parameter_ones():
    """Under ZeRO-1 over four ranks each updates a quarter; apex's DistributedFusedAdam then copies the gathered
    bf16 weights into every parameter (4 B each) and DeepSpeed's BF16_Optimizer norms and zeroes its full-size
    fp32 gradients (8 B each): (34/4 + 4) and (34/4 + 8) bytes per parameter at 3.35 TB/s."""
    h100, zero1 = Cluster("h100-sxm", 4), Layout(dp=4, zero=1)
    assert optimizer_time(h100, zero1, PARAMS, 8, "apex-distributed-adam") == pytest.approx(3.7313e-3, rel=1e-4)
    assert optimizer_time(h100, zero1, PARAMS, 8, "deepspeed-bf16") == pytest.approx(4.9254e-3, rel=1e-4)
    assert optimizer_time(h100, zero1, PARAMS, 8, "torch-fused-adamw") == pytest.approx(2.3881e-3, rel=1e-4)


def test_the_step_charges_its_implementation_and_another_stack_skips_plaits_publish():
    """The estimate's optimizer part moves by the bytes the implementations differ by (Composer's 92 against
    plait's 32 per parameter on one A100 at 2.039 TB/s); under ZeRO-1 plait's own publish of the bf16 weights
    is charged only for plait's step (another stack's copies are in its bytes)."""
    m, a100 = Model(4, 1024, 8, 32000, 1024), Cluster("a100-80gb", 1)
    params = max_rank_params(m, Layout())
    ours = estimate(m, a100, Layout(), Training(4))
    mosaic = estimate(m, a100, Layout(), Training(4, optimizer="composer-decoupled-adamw"))
    assert mosaic.time["optimizer"] - ours.time["optimizer"] == pytest.approx(60 * params / 2.039e12, rel=1e-9)
    assert mosaic.step_time_s - ours.step_time_s == pytest.approx(60 * params / 2.039e12, rel=1e-9)
    pair, zero1 = Cluster("a100-80gb", 2), Layout(dp=2, zero=1)
    assert publish_time(pair, zero1, params, 4, "bf16") > 0
    assert publish_time(pair, zero1, params, 4, "bf16", "megatron-core-bf16") == 0.0
    core = estimate(m, pair, zero1, Training(4, optimizer="megatron-core-bf16"))
    assert core.time["optimizer"] == pytest.approx(44 / 2 * params / 2.039e12, rel=1e-9)


def test_unknown_or_foreign_optimizers_are_refused():
    with pytest.raises(ConfigError, match="optimizer='adam': not one of torch-fused-adamw, megatron-fp16"):
        Training(4, optimizer="adam")
    with pytest.raises(ConfigError, match="optimizer: 'torch-foreach-adamw' is planned but plait's runtime runs "
                                          "torch-fused-adamw"):
        Layout(dp=2).to_parallel_config(Training(4, optimizer="torch-foreach-adamw"))
    assert Layout(dp=2).to_parallel_config(Training(4, masters="plait")).dp == 2


def test_deepspeeds_zero1_all_reduces_the_gradients_before_gathering_the_weights(monkeypatch):
    """DeepSpeed's fp16 ZeRO stage 1 (``step_end.ZERO1_ALL_REDUCE``: contiguous gradients forced off, so each
    bucket is all-reduced) then all-gathers the updated partitions, where plait's ZeRO-1 reduce-scatters: the same
    gather, twice the reduction's ring traffic. ZeRO-2 and no ZeRO are the same either way; BLOOM's search rows,
    which ran it, pay it in their step."""
    from dataclasses import replace

    from plait.plan import step_end
    from plait.plan.memory import max_rank_split
    from plait.plan.published import runs

    row = next(r for r in runs() if r.label == "BLOOM 181B search: dp24 tp8 pp2 mbs1")
    assert row.training.optimizer == "deepspeed-zero-fp16" and row.layout.zero == 1
    model, cluster, layout = row.model, row.cluster, row.layout
    n, span, grads = layout.dp, layout.tp * layout.dp, 2 * PARAMS  # fp16 gradients
    ours = step_end.dp_sync_parts(model, cluster, layout, PARAMS, "fp16")
    deepspeed = step_end.dp_sync_parts(model, cluster, layout, PARAMS, "fp16", optimizer="deepspeed-zero-fp16")
    assert ours[0] == pytest.approx(cluster.costs.collective("reduce_scatter", grads, n, span))
    assert deepspeed[0] == pytest.approx(cluster.costs.collective("all_reduce", grads, n, span))
    assert deepspeed[1] == ours[1] > 0 and deepspeed[0] > 1.9 * ours[0]
    for zero in (0, 2):
        other = replace(layout, zero=zero)
        assert step_end.dp_sync_parts(model, cluster, other, PARAMS, "fp16", optimizer="deepspeed-zero-fp16") == \
            step_end.dp_sync_parts(model, cluster, other, PARAMS, "fp16")

    def reduction() -> float:
        return estimate(model, cluster, layout, row.training).phases["grad_reduction"]

    charged = reduction()
    monkeypatch.setattr(step_end, "ZERO1_ALL_REDUCE", frozenset())
    params = sum(max_rank_split(model, layout))
    extra = (cluster.costs.collective("all_reduce", 2 * params, n, span)
             - cluster.costs.collective("reduce_scatter", 2 * params, n, span))
    assert charged - reduction() == pytest.approx(extra) and extra > 8.0  # seconds, of a 145 s step
