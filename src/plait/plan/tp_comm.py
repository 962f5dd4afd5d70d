"""What of a layer's tensor-parallel collectives the GEMMs beside them hide, on catalogue GPUs (``plan.gpu``).

Sequence parallelism's all-gathers and reduce-scatters (each ``c`` seconds on the ring formulas) as two stacks run
them: Transformer Engine's userbuffers, which cut each into per-rank pieces pipelined with the GEMM that consumes
or produces it (``userbuffers``: ``Training.tp_comm_overlap``), and the column-parallel layers' asynchronous
backward of Megatron-style layers without them (``async_backward``: ``Training.sp_async_backward``). Without
either, every collective is exposed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.errors import ConfigError
from plait.plan import experts
from plait.plan.gemm import gemm_speed

if TYPE_CHECKING:
    from plait.plan.catalogue import GPU
    from plait.plan.config import Layout
    from plait.plan.model import Model

# Tensor-parallel communication overlap (``Training.tp_comm_overlap``: Megatron-Core's tp_comm_overlap, Transformer
# Engine's userbuffers) decomposes each of sequence parallelism's gathers and scatters into per-rank pieces and
# pipelines them with the partial GEMMs that consume or produce them (Wang et al. 2023, "Overlap Communication with
# Dependent Computation via Decomposition in Large Deep Learning Models", ASPLOS, §4). In NeMo's userbuffers
# configurations the forward's reduce-scatters (proj_fprop, fc2_fprop) use the "pipeline" method in this many
# pieces (NVIDIA/NeMo nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py, commit d2b21556, every H100
# configuration; NVIDIA/dgxc-benchmarking nemo_megatron/cfg/gpt3_175b_hydra.yaml, commit 741c8860).
TP_OVERLAP_SPLITS = 4
# While a pipelined reduce-scatter runs, its kernels hold ``Training.tp_overlap_sms`` of the GPU's SMs (``GPU.sms``)
# and the GEMM beside it runs on the rest: with set_sm_margin the GEMM is launched on the SMs the kernels leave
# (NVIDIA/TransformerEngine transformer_engine/common/comm_gemm_overlap/comm_gemm_overlap.cpp at 3b2a7b00:
# _math_sms = sm_count - num_comm_sm); without it the two compete for them while both run, costed the same.


def overlapped_gather(comm: float, gemm: float, t: int) -> float:
    """What stays exposed of an all-gather (``comm`` seconds over ``t`` ranks) pipelined with the GEMM that
    consumes it (``gemm`` seconds) as a ring exchange: the GEMM on the piece a rank holds needs no transfer, the
    t-1 transfers run beside the t-1 other partial GEMMs (Wang et al. 2023, §4.1)."""
    if t <= 1:
        return comm
    return max(0.0, comm - gemm * (t - 1) / t)


def overlapped_scatter(comm: float, gemm: float, sm_share: float, splits: int = TP_OVERLAP_SPLITS) -> float:
    """What a reduce-scatter of a GEMM's output pipelined with it in ``splits`` pieces adds to the GEMM: each
    piece's scatter runs beside the next piece's GEMM, the last piece's scatter follows the GEMM's end, and the
    GEMM runs on the SMs the scatter's kernels leave it (``sm_share`` held), that much slower."""
    slow = gemm / (1 - sm_share)
    return slow - gemm + comm / splits + max(0.0, comm - slow) * (splits - 1) / splits


def bulk_overlap(comm: float, gemm: float) -> float:
    """What stays exposed of a collective run beside an independent GEMM of the backward (Transformer Engine's
    "bulk" overlaps: a column-parallel layer's input gather beside its data-gradient GEMM, its data-gradient
    reduce-scatter beside its weight-gradient GEMM)."""
    return max(0.0, comm - gemm)


def layer_gemm_seconds(gpu: GPU, model: Model, layout: Layout, tokens: float) -> tuple[float, float, float, float]:
    """Seconds of a layer's four TP GEMMs on a rank at the matmul speed, (QKV, output projection, the MLP's first,
    its last), each over the gathered ``[b, s/cp, n_in]``; a pass's data- and weight-gradient GEMMs take as long."""
    speed, t = gemm_speed(gpu), layout.tp
    h, q, kv = model.hidden, model.q_width, model.kv_heads * model.head_dim

    def gemm(n_in: int, n_out: int) -> float:
        return 2 * tokens * n_in * n_out / t / speed

    return (gemm(h, q + 2 * kv), gemm(q, h), gemm(h, model.ffn * (2 if model.glu else 1)), gemm(model.ffn, h))


def userbuffers(gpu: GPU, model: Model, layout: Layout, tokens: float, c: float,
                sms: tuple[int, int]) -> tuple[float, float]:
    """(forward, backward) exposed seconds of a layer's SP gathers and scatters (each ``c`` seconds) under
    tensor-parallel communication overlap. Forward: the gathers before QKV and the MLP's first GEMM
    (``overlapped_gather``), the scatters after the output projection and the MLP's last GEMM
    (``overlapped_scatter``, each holding its ``sms`` of those GEMMs': ``Training.tp_overlap_sms``). Backward
    (Megatron-LM with SP gathers a column-parallel layer's input again for its weight gradient): a
    column-parallel layer's input gather and data-gradient scatter beside its two GEMMs (``bulk_overlap``), a
    row-parallel layer's gradient gather ahead of its data-gradient GEMM (``overlapped_gather``). An MoE layer's
    own collectives stay exposed (``experts.tp_gathers``)."""
    t = layout.tp
    if gpu.sms < 1:
        raise ConfigError(f"tp_comm_overlap: {gpu.name} has no SM count in the catalogue (GPU.sms), which the "
                          "pipelined reduce-scatters' SM share needs; plan it with tp_comm_overlap=False")
    proj_share, fc2_share = (n / gpu.sms for n in sms)
    qkv, proj, up, down = layer_gemm_seconds(gpu, model, layout, tokens)
    f = overlapped_gather(c, qkv, t) + overlapped_scatter(c, proj, proj_share)
    b = 2 * bulk_overlap(c, qkv) + overlapped_gather(c, proj, t)
    if model.is_moe:
        moe_f, moe_b = experts.tp_gathers(layout)
        return f + moe_f * c, b + moe_b * c
    f += overlapped_gather(c, up, t) + overlapped_scatter(c, down, fc2_share)
    b += 2 * bulk_overlap(c, up) + overlapped_gather(c, down, t)
    return f, b


def async_backward(gpu: GPU, model: Model, layout: Layout, tokens: float, c: float) -> float:
    """Exposed seconds of a dense layer's SP backward as Megatron-style column-parallel layers run it without
    userbuffers: each (QKV, the MLP's first GEMM) gathers its input again on its own stream beside its
    data-gradient GEMM, waits, then reduce-scatters its input's gradient beside its weight-gradient GEMM
    (``bulk_overlap`` each); the row-parallel layers' gradient gathers (the backward of the forward's
    reduce-scatters) run before their GEMMs, exposed."""
    qkv, _, up, _ = layer_gemm_seconds(gpu, model, layout, tokens)
    return 2 * c + 2 * bulk_overlap(c, qkv) + 2 * bulk_overlap(c, up)
