"""Published training runs: the public evaluation set the datasheet GPU model is checked against.

Each run carries where its figure was printed, the figure exactly as printed, and the step time that figure
implies (``step_s``, with ``how`` saying the arithmetic). Layout details that the source does not print are
assumptions, listed per run in ``assumed``: they are the same for every run of a source. Only figures read in
a public text go in here (the file or table named in ``where``); nothing is remembered or interpolated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.plan.accumulation import RUNTIME_ACCUMULATION
from plait.plan.cluster import Cluster
from plait.plan.config import Layout, Training
from plait.plan.model import Model
from plait.plan.optimizers import RUNTIME_OPTIMIZER


@dataclass(frozen=True)
class PublishedRun:
    """One published training run and the step time its printed figure implies."""

    source: str  # the independent source (a team's report or repository): the unit held out
    where: str  # the paper / document and the table or file the figure is printed in
    label: str
    model: Model
    cluster: Cluster
    layout: Layout
    training: Training
    figure: str  # as printed
    step_s: float  # the step time the figure implies
    how: str  # how ``step_s`` follows from ``figure``
    assumed: tuple[str, ...] = field(default_factory=tuple)  # what the source does not print

    @property
    def gpu(self) -> str:
        return self.cluster.gpu.name


def tokens_step(batch: int, seq: int, tokens_per_s: float) -> float:
    return batch * seq / tokens_per_s


# ---- Narayanan et al. 2021 (SC'21), Table 1 ---------------------------------------------------------------
# Figures: the paper's Table 1 (arXiv 2104.04473), the same table as NVIDIA/Megatron-LM README
# images/cases_april2021.png (commit 50a4b5fa, 2021-04-08). Layouts: the paper's own launch script, NVIDIA/Megatron-LM
# examples/sc21/run_table_1.sh (commit de7dc40f): TP, PP, micro-batch, global batch, layers, hidden, heads,
# --checkpoint-activations, --num-layers-per-virtual-pipeline-stage, DDP impl; CONFIG.sh: seq 2048, fp16.
# --checkpoint-activations recomputes the transformer layers only (megatron/model/transformer.py
# ParallelTransformer._checkpointed_forward at that commit; the final norm and the logits run outside it), as eq. (3)
# counts: the logit layer three times, the layers four: Training(recompute_head=False) for every run of the paper.
# Gradients: fp16, kept and all-reduced in the parameters' dtype: CONFIG.sh passes --fp16 without
# --accumulate-allreduce-grads-in-fp32, which Megatron-LM at that commit leaves off for fp16 (megatron/arguments.py:
# only bf16 turns it on). Table 2's PTD runs are the same code; its ZeRO-3 runs DeepSpeed's fp16 (below).
# Recomputation re-runs each layer whole: Megatron-LM's own checkpoint (megatron/mpu/random.py CheckpointFunction at
# that commit, a torch.autograd.Function whose backward runs the layer's forward again under enable_grad) has no
# early stop, nor DeepSpeed's (deepspeed/runtime/activation_checkpointing/checkpointing.py CheckpointFunction, the
# same construction) for the ZeRO-3 rows, MT-NLG's and BLOOM's: Training(recompute_early_stop=False).
NARAYANAN_GRADS = "fp16"
# The optimizer step: Megatron-LM's Float16OptimizerWithFloat16Params around apex's FusedAdam at that commit (fp16,
# --clip-grad 1.0 by default: megatron/optimizer/__init__.py, optimizer.py, arguments.py), ``plan.optimizers``.
NARAYANAN_OPTIMIZER = "megatron-fp16"
# The weight gradients' accumulation: the local DDP of the pipelined rows keeps no contiguous buffer (CONFIG.sh does
# not pass --use-contiguous-buffers-in-ddp, fp16 leaves --accumulate-allreduce-grads-in-fp32 off), so autograd
# accumulates each fp16 gradient into param.grad, as it does under torch DDP's no_sync in the rows without a
# pipeline (megatron/model/distributed.py, schedules.py at that commit): "autograd-16bit" (``plan.accumulation``).
NARAYANAN_ACCUMULATION = "autograd-16bit"
# A pipelined run all-reduces the word embeddings' whole gradient over the first and last stages after the DP
# all-reduce (megatron/training.py train_step at that commit): "full" (``plan.step_end.tied_sum_time``); also MT-NLG's
# (DeepSpeed's ReduceTiedGrads), NeMo's (v1.11.0 allreduce_first_last_embeddings) and BLOOM's rows below.
TIED_FULL = "full"
# The layers' cut (``Layout.partition``): equal counts. Megatron-LM builds num_layers // pp a stage and asserts they
# divide (megatron/model/transformer.py ParallelTransformer, de7dc40f), as NeMo 1.11.0 does (its megatron
# transformer.py get_num_layers); Megatron-DeepSpeed's GPTModelPipe (MT-NLG, BLOOM's search) passes DeepSpeed
# partition_method "type:transformer" (bigscience-workshop/Megatron-DeepSpeed megatron/model/gpt_model.py, 99c8fe07,
# 2022-02-25): weight 1 a transformer layer, 0 the rest (deepspeed/runtime/pipe/module.py _partition_layers, v0.5.10).
MEGATRON_CUT = "uniform"
NARAYANAN_WHERE = ("Narayanan et al. 2021 (SC'21, arXiv 2104.04473), Table 1 (also NVIDIA/Megatron-LM README "
                   "images/cases_april2021.png); layouts from examples/sc21/run_table_1.sh")
# (layers, hidden, heads, tp, pp, micro-batch, global batch, layers per virtual stage or 0, torch DDP, GPUs,
#  TFLOP/s per GPU as printed)
NARAYANAN_TABLE1 = (
    (24, 2304, 24, 1, 1, 16, 512, 0, True, 32, 137), (30, 3072, 32, 2, 1, 16, 512, 0, True, 64, 138),
    (36, 4096, 32, 4, 1, 16, 512, 0, True, 128, 142), (40, 6144, 48, 8, 1, 8, 1024, 0, True, 256, 135),
    (48, 8192, 64, 8, 2, 4, 1536, 0, False, 512, 138), (60, 10240, 80, 8, 4, 2, 1792, 5, False, 1024, 140),
    (80, 12288, 96, 8, 8, 2, 2304, 5, False, 1536, 148), (96, 16384, 128, 8, 16, 1, 2160, 3, False, 1920, 155),
    (105, 20480, 128, 8, 35, 1, 2520, 1, False, 2520, 163), (128, 25600, 160, 8, 64, 1, 3072, 0, False, 3072, 163),
)


# Same paper, Table 2 (PTD parallelism against ZeRO-3 without model parallelism; also cli99/llm-analysis
# figures/megatron-lm-2nd-table-2.png): (scheme, parameters, model-parallel size, batch, GPUs, micro-batch,
# TFLOP/s per GPU). Model-parallel 96 is t8 p12 for 174.6B, 280 is t8 p35 for 529.6B (cli99/llm-analysis
# examples/megatron-lm/run_train.sh).
NARAYANAN_T2_WHERE = ("Narayanan et al. 2021 (SC'21, arXiv 2104.04473), Table 2 (also cli99/llm-analysis "
                      "figures/megatron-lm-2nd-table-2.png)")
NARAYANAN_TABLE2 = (
    ("ZeRO-3", 174.6, 1, 1536, 384, 4, 144), ("ZeRO-3", 174.6, 1, 1536, 768, 2, 88),
    ("ZeRO-3", 174.6, 1, 1536, 1536, 1, 44), ("ZeRO-3", 529.6, 1, 2560, 640, 4, 138),
    ("ZeRO-3", 529.6, 1, 2240, 1120, 2, 98), ("ZeRO-3", 529.6, 1, 2240, 2240, 1, 48),
    ("PTD", 174.6, 96, 1536, 384, 1, 153), ("PTD", 174.6, 96, 1536, 768, 1, 149),
    ("PTD", 174.6, 96, 1536, 1536, 1, 141), ("PTD", 529.6, 280, 2240, 560, 1, 171),
    ("PTD", 529.6, 280, 2240, 1120, 1, 167), ("PTD", 529.6, 280, 2240, 2240, 1, 159),
)
NARAYANAN_SHAPES = {174.6: (96, 12288, 96, 12), 529.6: (105, 20480, 128, 35)}  # layers, hidden, heads, p
# The ZeRO-3 runs are DeepSpeed's of the paper's time (v0.3.13, 2021-03-16), costed as its code runs them with
# contiguous_gradients on, as every ZeRO-3 configuration DeepSpeed published then sets it (the paper prints none;
# ``plan.zero3_deepspeed`` names them), its other settings at v0.3.13's defaults; grad_dtype fp16. docs/planner.md
# ("Where it misses") says what that leaves.


def gpt(layers: int, hidden: int, heads: int, vocab: int = 51200, seq: int = 2048, name: str = "") -> Model:
    """A GPT-3-style model as Megatron-LM builds it: biases, LayerNorm, learned positions, tied embeddings, and
    dropout (Megatron-LM's defaults, --hidden-dropout and --attention-dropout 0.1: megatron/arguments.py at
    de7dc40f; Narayanan et al.'s, MT-NLG's and NeMo's yamls (hidden_dropout 0.1) keep them)."""
    return Model(layers, hidden, heads, vocab, seq, bias=True, layernorm=True, learned_positions=True,
                 tied_embeddings=True, dropout=True, name=name or f"gpt-{layers}x{hidden}")


def narayanan_flops(m: Model, batch: int) -> float:
    """Narayanan et al. 2021, eq. (3): the FLOPs one step of their runs does, recomputation's forward
    included: 96·B·s·l·h²·(1 + s/(6h) + V/(16lh))."""
    b, s, l, h, v = batch, m.seq_len, m.n_layers, m.hidden, m.vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def _narayanan() -> list[PublishedRun]:
    out = []
    for layers, hidden, heads, t, p, mbs, batch, per_v, torch_ddp, n, tflops in NARAYANAN_TABLE1:
        m = gpt(layers, hidden, heads)
        v = layers // p // per_v if per_v else 1
        layout = Layout(tp=t, pp=p, dp=n // (t * p), virtual_stages=v, microbatch_size=mbs, recompute="full",
                        schedule="interleaved-1f1b" if v > 1 else "1f1b", partition=MEGATRON_CUT)
        step = narayanan_flops(m, batch) / (n * tflops * 1e12)
        out.append(PublishedRun(
            "Narayanan et al. 2021", NARAYANAN_WHERE, f"GPT {m.n_params() / 1e9:.1f}B on {n} A100", m,
            Cluster("a100-80gb", n, interconnect="ib-hdr", flash_attention=False), layout,
            Training(batch, overlap_grad_reduce=torch_ddp, recompute_head=False, grad_dtype=NARAYANAN_GRADS,
                     recompute_early_stop=False, optimizer=NARAYANAN_OPTIMIZER,
                     grad_accumulation=NARAYANAN_ACCUMULATION, tied_grad_sum=TIED_FULL),
            f"{tflops} teraFLOP/s per GPU", step, "eq. (3) FLOPs / (GPUs x TFLOP/s)",
            ("DDP=torch overlaps the gradient all-reduce, DDP=local does not",
             "fp16 costed as bf16", "Selene: HDR InfiniBand, 8 x 200 Gb/s per node")))
    for scheme, size, mp, batch, n, mbs, tflops in NARAYANAN_TABLE2:
        layers, hidden, heads, p = NARAYANAN_SHAPES[size]
        m = gpt(layers, hidden, heads)
        ptd = scheme == "PTD"
        layout = (Layout(tp=8, pp=p, dp=n // mp, microbatch_size=mbs, recompute="full", partition=MEGATRON_CUT)
                  if ptd else Layout(dp=n, microbatch_size=mbs, recompute="full", zero=3))
        step = narayanan_flops(m, batch) / (n * tflops * 1e12)
        out.append(PublishedRun(
            "Narayanan et al. 2021", NARAYANAN_T2_WHERE, f"GPT {size}B on {n} A100, {scheme}", m,
            Cluster("a100-80gb", n, interconnect="ib-hdr", flash_attention=False), layout,
            Training(batch, overlap_grad_reduce=not ptd, recompute_head=False, grad_dtype=NARAYANAN_GRADS,
                     recompute_early_stop=False,
                     optimizer=NARAYANAN_OPTIMIZER if ptd else RUNTIME_OPTIMIZER,
                     grad_accumulation=NARAYANAN_ACCUMULATION if ptd else RUNTIME_ACCUMULATION,
                     tied_grad_sum=TIED_FULL if ptd else "shard",  # ZeRO-3 rows: no pipeline, nothing summed
                     zero3_impl="plait" if ptd else "deepspeed-0.3-contiguous"),
            f"{tflops} teraFLOP/s per GPU", step, "eq. (3) FLOPs / (GPUs x TFLOP/s)",
            ("1F1B, not interleaved" if ptd else "DeepSpeed ZeRO-3 (v0.3.13) as its code runs it, contiguous_gradients "
             "on as every ZeRO-3 configuration DeepSpeed published then, its other defaults",
             "full recomputation (eq. 3 counts it)",
             "PTD: gradient all-reduce after the backward" if ptd else "ZeRO-3: no DeepSpeed configuration printed",
             "Selene: HDR InfiniBand") + (() if ptd else (
                 "torch and hosts not printed: a gather's W views and copies at host costs measured here",
                 "optimizer: DeepSpeed v0.3.13's ZeRO-3 step not read, costed as plait's (torch-fused-adamw)",
                 "gradient accumulation: DeepSpeed v0.3.13's not read, costed as plait's ZeRO-3 (one micro-batch)"))))
    return out


# ---- Smith et al. 2022 (MT-NLG 530B) -----------------------------------------------------------------------
# "with global batch size 1920 on 280, 350, and 420 DGX A100 servers ... the latency per iteration observed is
# 60.1, 50.2, and 44.4 seconds respectively. These correspond to 126, 121, and 113 TFLOP/s per GPU" (Smith et
# al. 2022, §2.4, as quoted in cli99/llm-analysis examples/megatron-turing-nlg/README.md; its run_train.sh: 8-way
# tensor and 35-way pipeline parallelism, vocab 50272). Megatron-DeepSpeed's GPTModelPipe: DeepSpeed's pipeline
# checkpoints only its ParallelTransformerLayerPipe layers (microsoft/DeepSpeed deepspeed/runtime/pipe/module.py,
# PipelineModule._is_checkpointable, v0.5.10): the head is not recomputed (also BLOOM's runs below). Its
# TrainSchedule issues ReduceGrads only after the last micro-batch's steps (deepspeed/runtime/pipe/schedule.py,
# microsoft/DeepSpeed at af8f2596): the DP gradient reduction follows the backward, not beside it
# (Training(overlap_grad_reduce=False), also BLOOM's runs below). The GPU: "Each cluster node has 8 NVIDIA 80-GB
# A100 GPUs, connected to each other by NVLink and NVSwitch", bf16 mixed precision, eight 200 Gb/s HDR InfiniBand
# HCAs a node (Smith et al. 2022, the paragraph on Selene's hardware); llm-analysis's example annotates these runs
# as A100-SXM 40GB (its run_train.sh's gpu_name a100-sxm-40gb), which the paper does not say: costed as 80 GB.
SMITH_WHERE = ("Smith et al. 2022 (MT-NLG), Section 2.4, as quoted in cli99/llm-analysis "
               "examples/megatron-turing-nlg/README.md and run_train.sh")
# Its gradient dtype is not printed in what is read here: costed as plait keeps them (fp32).


def _smith() -> list[PublishedRun]:
    m = gpt(105, 20480, 128, vocab=51200, name="mt-nlg-530b")  # 50272 padded to a multiple of 128·t
    out = []
    for nodes, step, tflops in ((280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113)):
        n = 8 * nodes
        out.append(PublishedRun(
            "Smith et al. 2022 (MT-NLG)", SMITH_WHERE, f"MT-NLG 530B on {n} A100", m,
            Cluster("a100-80gb", n, interconnect="ib-hdr", flash_attention=False),
            Layout(tp=8, pp=35, dp=n // 280, recompute="full", zero=1, partition=MEGATRON_CUT),
            Training(1920, overlap_grad_reduce=False, recompute_head=False, tied_grad_sum=TIED_FULL,
                     recompute_early_stop=False),
            f"{step} s per iteration ({tflops} TFLOP/s per GPU)", step, "printed step time",
            ("micro-batch 1", "1F1B (DeepSpeed's pipeline), not interleaved", "full recomputation",
             "ZeRO-1 (DeepSpeed)", "vocab 50272 padded to 51200", "Selene: HDR InfiniBand",
             "optimizer: DeepSpeed's version not printed, costed as plait's (torch-fused-adamw)",
             "gradient accumulation: DeepSpeed's version not printed, costed as plait's (ZeRO-1, bf16)")))
    return out


# ---- NVIDIA NeMo Megatron launcher README, §7.1.2 (A100 80GB, bf16) ----------------------------------------
# NVIDIA/NeMo-Megatron-Launcher README.md (commit 3579cdb3, 2022-09-07), "Training Performance Results": tokens per
# second of GPT-3 5B on 1-32 DGX A100 nodes and 175B on 8-128; layouts: conf/training/gpt3/{5b,175b}.yaml at the
# same commit (5B: t1 p1 micro-batch 2, global batch 2048, no recomputation; 175B: t8 p8 micro-batch 2, global
# batch 2048, sequence parallel, selective recomputation; both distributed fused Adam). Gradients: fp32, as
# the yamls set no optim.grad_sync_dtype: apex's DistributedFusedAdam then synchronises them in its state dtype,
# fp32 (NVIDIA/apex apex/contrib/optimizers/distributed_fused_adam.py: "grad_sync_dtype ... (default: same as
# dtype)"), and NeMo of that date passes only param_sync_dtype (NVIDIA/NeMo commit d29a66bc, 2022-09-07,
# megatron_gpt_model.py setup_optimization). Gradient reduction: NeMo v1.11.0 (the 22.08 container the README's
# software table names, NeMo 1.11.0) turns apex's overlapped reduce-scatter off under a pipeline or sequence
# parallelism (megatron_gpt_model.py configure_optimizers: "Overlapped communication interferes with grad reductions
# for pipeline parallelism and sequence parallelism", overlap_grad_sync = False), so DistributedFusedAdam.step
# reduce-scatters every bucket after the backward, then all-gathers the updated bf16 weights (NVIDIA/apex
# distributed_fused_adam.py at 6f7d8ac3, step: grad_sync(), then all_gather per bucket): the 175B rows' reduction
# follows the backward (Training(overlap_grad_reduce=False)). The 5B rows (no pipeline, no SP) keep apex's default
# overlap: NeMo runs their earlier micro-batches under no_sync(greedy_grad_copy=True), the last one's backward launching
# each bucket's reduce-scatter as it fills.
# The optimizer step: apex's DistributedFusedAdam of that date (apex defaults: store_params, fp32 state), NeMo
# clipping through its clip_grad_norm (NVIDIA/NeMo v1.11.0 megatron_base_model.py configure_gradient_clipping,
# clip_grads.py clip_grad_norm_distributed_optimizer): "apex-distributed-adam" (``plan.optimizers``).
NEMO_OPTIMIZER = "apex-distributed-adam"
# The weight gradients' accumulation: the yamls set gradient_accumulation_fusion: True and megatron_amp_O2: True;
# NeMo v1.11.0 keeps the fusion only with a pipeline (megatron_base_model.py _validate_config), so the 175B rows
# accumulate their GEMM weights in the GEMM and the 5B rows through apex's hook ("apex-distributed-adam-fused",
# "apex-distributed-adam": ``plan.accumulation``).
NEMO_ACCUMULATION = {False: "apex-distributed-adam", True: "apex-distributed-adam-fused"}
# SP's backward (175B): NeMo 1.11.0's apex (Dockerfile: NVIDIA/apex 3c19f106) gathers each column-parallel layer's
# input again and reduce-scatters its gradient, async_op, beside its two backward GEMMs; the launcher sets
# CUDA_DEVICE_MAX_CONNECTIONS=1 at TP > 1 (bignlp/core/stages.py at 3579cdb3).
NEMO_WHERE = ("NVIDIA/NeMo-Megatron-Launcher README §7.1.2 (commit 3579cdb3); layouts from "
              "conf/training/gpt3/5b.yaml and 175b.yaml at that commit")
NEMO_5B = ((1, 40345), (2, 79815), (4, 161754), (8, 312774), (16, 659481), (32, 1159288))
NEMO_175B = ((8, 7500), (16, 14950), (32, 29537), (64, 58211), (128, 109684))


def _nemo() -> list[PublishedRun]:
    out = []
    assumed = ("the benchmark ran the yaml of that commit", "distributed fused Adam costed as ZeRO-1",
               "no TP communication or weight-gather overlap (the yamls configure neither)",
               "vocab 50257 padded to 50304", "DGX SuperPOD: HDR InfiniBand")
    m5 = gpt(24, 4096, 32, vocab=50304, name="gpt3-5b")
    for nodes, tps in NEMO_5B:
        n = 8 * nodes
        out.append(PublishedRun("NVIDIA NeMo Megatron", NEMO_WHERE, f"GPT-3 5B on {n} A100", m5,
                                Cluster("a100-80gb", n, interconnect="ib-hdr", flash_attention=False),
                                Layout(dp=n, microbatch_size=2, zero=1),
                                Training(2048, optimizer=NEMO_OPTIMIZER, grad_accumulation=NEMO_ACCUMULATION[False]),
                                f"{tps} tokens per second", tokens_step(2048, 2048, tps),
                                "global batch x seq / tokens per second", assumed))
    m175 = gpt(96, 12288, 96, vocab=50304, name="gpt3-175b")
    for nodes, tps in NEMO_175B:
        n = 8 * nodes
        out.append(PublishedRun("NVIDIA NeMo Megatron", NEMO_WHERE, f"GPT-3 175B on {n} A100", m175,
                                Cluster("a100-80gb", n, interconnect="ib-hdr", flash_attention=False),
                                Layout(tp=8, pp=8, dp=n // 64, microbatch_size=2, sequence_parallel=True,
                                       recompute="selective", zero=1, partition=MEGATRON_CUT),
                                Training(2048, overlap_grad_reduce=False, optimizer=NEMO_OPTIMIZER,
                                         grad_accumulation=NEMO_ACCUMULATION[True], tied_grad_sum=TIED_FULL,
                                         sp_async_backward=True),
                                f"{tps} tokens per second", tokens_step(2048, 2048, tps),
                                "global batch x seq / tokens per second",
                                assumed + ("1F1B, not interleaved", "NeMo 1.11.0: no gradient-reduction overlap "
                                           "under a pipeline (configure_optimizers)")))
    return out


def runs() -> list[PublishedRun]:
    """The whole evaluation set, source by source (BigScience's in ``plan.published_bloom``, the FSDP sources in
    ``plan.published_fsdp``, the H100 sources of 2024-2025 in ``plan.published_h100``)."""
    from plait.plan import published_bloom, published_fsdp, published_h100  # they build on this module's PublishedRun

    return (_narayanan() + _smith() + _nemo() + published_bloom.runs() + published_fsdp.mosaic()
            + published_fsdp.torchtitan() + published_h100.runs())


def sources(rs: list[PublishedRun] | None = None) -> list[str]:
    """The independent sources, in the order of ``runs``."""
    return list(dict.fromkeys(r.source for r in (rs if rs is not None else runs())))


@dataclass(frozen=True)
class MemoryStatement:
    """A published statement that a layout fitted in (or ran out of) its GPUs' memory."""

    source: str
    where: str
    label: str
    model: Model
    cluster: Cluster
    layout: Layout
    training: Training
    fits: bool
    printed: str  # as printed


def memory_statements() -> list[MemoryStatement]:
    """Published fit / out-of-memory statements the memory model is checked against (the H100 sources' in
    ``plan.published_memory``)."""
    from plait.plan import published_memory  # it builds on this module's MemoryStatement

    m = gpt(105, 20480, 128)
    printed = ("The 530-billion-parameter GPT model did not fit on 560 GPUs when using a microbatch size of 4 with "
               "ZeRO-3, so we increased the number of GPUs used to 640 and global batch size to 2560")
    out = []
    for n, batch, fits in ((560, 2240, False), (640, 2560, True)):
        out.append(MemoryStatement(
            "Narayanan et al. 2021", "Narayanan et al. 2021 (SC'21), Table 2 caption (cli99/llm-analysis "
            "figures/megatron-lm-2nd-table-2.png)", f"GPT 529.6B, ZeRO-3, micro-batch 4, {n} A100 80GB", m,
            Cluster("a100-80gb", n, interconnect="ib-hdr", flash_attention=False),
            Layout(dp=n, microbatch_size=4, recompute="full", zero=3),
            Training(batch, recompute_head=False, grad_dtype=NARAYANAN_GRADS), fits, printed))
    return out + published_memory.fit_statements()
