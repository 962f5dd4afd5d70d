"""Published FSDP training runs: MosaicML's llm-foundry MPT benchmarks (FSDP FULL_SHARD) and torchtitan's FSDP2 runs.

Part of the public evaluation set (``plan.published``, where ``PublishedRun`` and the rule live: only figures read
in a public text, each with where it is printed and how the step time follows from it).
"""

from __future__ import annotations

from plait.plan.catalogue import GB, Link
from plait.plan.cluster import Cluster
from plait.plan.config import Layout, Training
from plait.plan.model import Model
from plait.plan.published import PublishedRun, tokens_step

# ---- MosaicML llm-foundry MPT benchmarks (FSDP) ------------------------------------------------------------
# mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7c, 2023-10-17): Throughput (T/s) of MPT
# models under FSDP FULL_SHARD; shapes from scripts/train/yamls/pretrain/mpt-*.yaml (vocab 50368, expansion
# ratio 4, no biases; the table's NumParams grow with the sequence length: learned positions). Activation checkpointing
# wraps each MPTBlock (llmfoundry/models/mpt/modeling_mpt.py activation_checkpointing_fn at that commit), inside its
# FSDP unit (Composer wraps the model in FSDP first, then checkpoint-wraps the matching modules that are not FSDP
# units: mosaicml/composer composer/trainer/dist_strategy.py at b71375a3): the head is not recomputed and the
# recompute finds the block's weights gathered. The yamls' activation_checkpointing_reentrant: false has Composer
# wrap each block in checkpoint_wrapper(CheckpointImpl.NO_REENTRANT), torch's non-reentrant checkpoint, which stops
# its recomputation early from torch 2.1 on (PyTorch #96866, March 2023, after the 2.0 branch;
# ``Training.recompute_early_stop``): the H100 rows' torch 2.1.0.dev20230821 does, the A100 rows' 2.0.1 and
# 1.13.1 do not.
# The table's A100 rows come from two campaigns. MPT-70B's (bf16, PURE) is the April 2023 figure of mosaicml/examples
# 9fa3ceb9 (examples/llm/throughput: release/v0.0.4 on image mosaicml/pytorch:1.13.1_cu117), reprinted unchanged; the
# other A100 rows are October's (4b482bd6 "updated a100 numbers": image mosaicml/pytorch:2.0.1_cu118, code
# crinard/llm-foundry branch add_attns at 9859200, llm-foundry main of 2023-08-31 with benchmark scripts, whose
# setup.py pins mosaicml>=0.15.0,<0.16 and torch<=2.0.1). The H100 rows ran torch 2.1.0.dev20230821 and Composer
# 784f50be (below).
# Gradients: reduced in bf16. Every row prints its "MP Mode" (DEFAULT with amp_bf16, PURE with bf16); in Composer
# v0.15.1 (composer/trainer/mosaic_fsdp.py) and v0.16.3 (composer/trainer/mosaic_fsdp_utils.py) alike,
# get_mixed_precision's DEFAULT leaves FSDP's reduce_dtype unset and PURE sets it to the precision, and an unset
# reduce_dtype takes param_dtype, bf16 (torch.distributed.fsdp.MixedPrecision).
MOSAIC_WHERE = "mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7c), {table}"
MPT = {"760m": (24, 1536, 12), "1b": (24, 2048, 16), "3b": (32, 2560, 20), "7b": (32, 4096, 32),
       "13b": (40, 5120, 40), "30b": (48, 7168, 56), "70b": (80, 8192, 64)}
# (table, model, seq, GPUs, micro-batch, global batch, activation checkpointing, Throughput (T/s) as printed)
MOSAIC_ROWS = (
    ("H100 80GB BF16", "70b", 2048, 64, 8, 2048, True, 66523),
    ("H100 80GB BF16", "30b", 2048, 16, 10, 480, True, 36209),
    ("H100 80GB BF16", "13b", 2048, 8, 2, 16, False, 38336),
    ("H100 80GB BF16", "13b", 4096, 8, 10, 240, True, 37740),
    ("H100 80GB BF16", "7b", 2048, 8, 6, 48, False, 85144),
    ("H100 80GB BF16", "7b", 8192, 8, 8, 128, True, 55481),
    ("H100 80GB BF16", "3b", 2048, 16, 10, 480, False, 386285),
    ("H100 80GB BF16", "3b", 8192, 8, 3, 144, False, 132626),
    ("H100 80GB BF16", "1b", 2048, 8, 14, 112, False, 363645),
    ("H100 80GB BF16", "760m", 2048, 16, 24, 384, False, 1096819),
    ("A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "70b", 2048, 64, 8, 2048, True, 26274),
    ("A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "30b", 2048, 8, 3, 504, True, 7330),
    ("A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "13b", 2048, 8, 2, 48, False, 18097),
    ("A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "7b", 2048, 8, 6, 96, False, 37130),
    ("A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "3b", 2048, 8, 10, 160, False, 86491),
    ("A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "1b", 2048, 8, 14, 448, False, 164109),
)
ROCE_200 = Link("RoCE 200 Gb/s per GPU (1600 Gb/s per node)", 25 * GB, 8e-6)
# The attention kernel: the yamls at that commit set ``attn_impl: triton`` and so does submit_benchmarks.py's
# default (sweep.sh passes no --attn_impl), which runs llmfoundry/models/layers/flash_attn_triton.py: "Copied from
# HazyResearch/flash-attention ... flash_attn/flash_attn_triton.py", FlashAttention's (v1) Triton port on the
# pre-MLIR Triton compiler (setup.py: triton-pre-mlir; flash-attn==1.0.9 in the gpu extra). The H100 BF16 rows ran
# image mosaicml/pytorch:2.1.0_cu121-nightly20230827 at amp_bf16 (the benchmarks' h100new.csv, removed from the
# repository at 803e6718 when the table moved into the README), not FP8, which has a table of its own. The port has
# no published speed on any GPU (the "FlashAttention Triton" bars of FlashAttention-2's README are OpenAI Triton's
# triton.ops.flash_attention: ``plan.attention``); its author's note in the file (Dao-AILab/flash-attention
# flash_attn/flash_attn_triton.py at v1.0.9: "Overall Triton forward + backward is slightly slower than CUDA forward
# + backward", tested on A100) puts FlashAttention v1's CUDA kernel ("flash1") just ahead of it, so every row, A100
# and H100, is costed at that kernel's published speed.
MOSAIC_ATTENTION = "attn_impl: triton (the yamls, submit_benchmarks.py's default): FlashAttention v1's Triton port"
MOSAIC_KERNEL = "flash1"  # the port's author's reference: no published figure of the port itself
# The optimizer step: the yamls' "optimizer: name: decoupled_adamw" (weight_decay 0.0) and "algorithms:
# gradient_clipping: clipping_type: norm", Composer's DecoupledAdamW and FSDP's clip_grad_norm_ under the Composer of
# that commit (v0.16.3): "composer-decoupled-adamw" (``plan.optimizers``).
MOSAIC_OPTIMIZER = "composer-decoupled-adamw"
# The weight gradients' accumulation: FSDP FULL_SHARD reduce-scatters in every backward (Composer v0.16.3 enters no
# no_sync for FSDP) with the yamls' mixed_precision PURE (bf16 reduction) and accumulates the fp32 shard:
# "fsdp1-bf16" (``plan.accumulation``).
MOSAIC_ACCUMULATION = "fsdp1-bf16"


def mpt(size: str, seq: int) -> Model:
    """An MPT model of the table: no dropout (the yamls set none and llmfoundry/models/mpt/configuration_mpt.py at
    061f2c7c defaults attn_pdrop, resid_pdrop and emb_pdrop to 0)."""
    layers, d, heads = MPT[size]
    return Model(layers, d, heads, 50368, seq, layernorm=True, learned_positions=True, tied_embeddings=True,
                 name=f"mpt-{size}")


def mosaic() -> list[PublishedRun]:
    out = []
    for table, size, seq, n, mbs, batch, ckpt, tps in MOSAIC_ROWS:
        h100 = table.startswith("H100")
        out.append(PublishedRun(
            "MosaicML llm-foundry", MOSAIC_WHERE.format(table=table),
            f"MPT-{size} seq {seq} on {n} {'H100' if h100 else 'A100'}", mpt(size, seq),
            Cluster("h100-sxm" if h100 else "a100-80gb", n, interconnect=None if h100 else ROCE_200,
                    flash_attention=MOSAIC_KERNEL),
            Layout(dp=n, microbatch_size=mbs, recompute="full" if ckpt else "none", zero=3),
            Training(batch, recompute_head=False, grad_dtype="bf16", optimizer=MOSAIC_OPTIMIZER,
                     grad_accumulation=MOSAIC_ACCUMULATION, recompute_early_stop=h100),
            f"Throughput (T/s) {tps}", tokens_step(batch, seq, tps), "global batch x seq / tokens per second",
            ("FSDP FULL_SHARD costed as ZeRO-3",
             MOSAIC_ATTENTION + ", costed as FlashAttention v1's CUDA kernel (no published figure of the port)",
             "H100 fabric not printed: NDR InfiniBand assumed" if h100 else "RoCE: 200 Gb/s per GPU")))
    return out


# ---- torchtitan (FSDP2 on 64 A100 80GB) --------------------------------------------------------------------
# pytorch/torchtitan docs/performance.md (commit 04133643): WPS (tokens per second per GPU) of Llama 3 70B (local
# batch 1, full activation checkpointing: 331) and Llama 2 13B (local batch 2, none: 2162) and 70B (local batch
# 2, full: 353) with FSDP2 on 64 A100 80GB; global batch = local batch x 64. Full AC wraps each TransformerBlock in a
# checkpoint wrapper before fully_shard (torchtitan/parallelisms/parallelize_llama.py at that commit): the head is not
# recomputed, and the recompute runs inside the block's FSDP unit, its weights gathered. The wrapper is
# ptd_checkpoint_wrapper(..., CheckpointImpl.NO_REENTRANT, use_reentrant=False) on torch >= 2.2 nightlies: torch's
# non-reentrant checkpoint, which stops early (Training(recompute_early_stop=True), as plait's own runtime). Gradients:
# reduced in fp32 (the same file: MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
# plait's default.
TITAN_WHERE = "pytorch/torchtitan docs/performance.md (commit 04133643), Llama 3 and Llama 2 tables"
# The optimizer step: train.py at that commit builds torch.optim.AdamW(..., weight_decay=0.1, foreach=True) and clips
# with torch.nn.utils.clip_grad_norm_(..., foreach=True): "torch-foreach-adamw" (``plan.optimizers``).
TITAN_OPTIMIZER = "torch-foreach-adamw"
# The weight gradients' accumulation: FSDP2's reduce-scatter of each backward with reduce_dtype float32, one
# micro-batch a step (train.py at that commit has no gradient accumulation): "fsdp2-fp32" (``plan.accumulation``).
TITAN_ACCUMULATION = "fsdp2-fp32"
# torchtitan's Llama (torchtitan/models/llama/model.py) has no dropout, as Model's default.
LLAMA2_13B = Model(40, 5120, 40, 32000, 4096, 13824, glu=True, name="llama2-13b")
LLAMA2_70B = Model(80, 8192, 64, 32000, 4096, 28672, 8, glu=True, name="llama2-70b")


def torchtitan() -> list[PublishedRun]:
    rows = ((Model.preset("llama3-70b"), 1, "full", 331), (LLAMA2_13B, 2, "none", 2162),
            (LLAMA2_70B, 2, "full", 353))
    out = []
    for m, local, rc, wps in rows:
        batch = 64 * local
        out.append(PublishedRun(
            "torchtitan", TITAN_WHERE, f"{m.name} on 64 A100, {rc} AC", m,
            Cluster("a100-80gb", 64, flash_attention="flash2"),
            Layout(dp=64, microbatch_size=local, recompute=rc, zero=3),
            Training(batch, recompute_head=False, optimizer=TITAN_OPTIMIZER, grad_accumulation=TITAN_ACCUMULATION,
                     recompute_early_stop=True),
            f"WPS {wps}", tokens_step(batch, m.seq_len, wps * 64), "global batch x seq / (WPS x 64)",
            ("FSDP2 costed as ZeRO-3", "PyTorch SDPA: its flash backend, FlashAttention-2, on A100",
             "fabric not printed: HDR InfiniBand assumed")))
    return out
