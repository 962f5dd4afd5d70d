"""Published memory figures and fit statements the planner's memory model (``plan.memory``) is checked against.

Two kinds: byte counts a paper prints for one GPU (ZeRO's model states, Korthikanti et al.'s activations per
layer), which the planner's own terms must reproduce; and statements that a published layout fitted in its GPUs
(``plan.published.MemoryStatement``). As in ``plan.published``: only figures read in a public text, each with
where it is printed.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.cluster import Cluster
from plait.plan.config import Layout, Training
from plait.plan.estimate import estimate
from plait.plan.memory import state_bytes
from plait.plan.model import Model
from plait.plan.published import MemoryStatement, gpt, runs
from plait.plan.published_bloom import (
    BLOOM_PREQUEL,
    BLOOM_PREQUEL_GRADS,
    BLOOM_PREQUEL_WHERE,
    OMNIPATH,
    bloom_model,
    bloom_prequel_layout,
)
from plait.plan.published_h100 import (
    DGXC_GRADS,
    DGXC_ROWS,
    DGXC_WHERE,
    META_PP,
    META_ROWS,
    META_TP,
    META_V,
    META_WHERE,
    dgxc_model,
)


@dataclass(frozen=True)
class ByteFigure:
    """Bytes on one GPU as a paper prints them, and what the planner counts for the same setup.

    ``kind``: "model states" (weights, gradients and optimizer state on one GPU of ``layout``'s first pipeline
    rank, ``plan.memory.state_bytes``, the gradients in ``training``'s ``grad_dtype`` (fp32 without one); with
    ``params``, those of a model of ``params`` parameters without pipeline or tensor parallelism, scaled from
    ``model``), "layer activations"
    (one layer's stored activations for one micro-batch, the cost model's count for ``cluster``) or "reserved
    peak" (the caching allocator's reserved peak of the most loaded GPU, as a run logged it, against ``estimate``'s
    total for ``training``: the planner counts allocated bytes, which the reservation bounds from above, the gap
    being blocks the allocator keeps cached but free; the figure agrees when the count does not exceed it).
    """

    source: str
    where: str
    label: str
    kind: str
    printed: str  # as printed
    published: float  # bytes the printed figure states
    model: Model
    layout: Layout
    cluster: Cluster
    params: float = 0.0
    tolerance: float = 0.02  # relative: the printed figures are rounded to two or three digits
    training: Training | None = None

    def planner(self) -> float:
        """The planner's bytes for this figure."""
        if self.kind == "model states":
            layers = self.model.n_layers // self.layout.pp
            grads = self.training.grad_dtype if self.training is not None else "fp32"
            held = sum(state_bytes(self.model, self.layout, layers, True, self.layout.pp == 1, "bf16", grads))
            return held * self.params / self.model.n_params() if self.params else held
        if self.kind == "reserved peak" and self.training is not None:
            return estimate(self.model, self.cluster, self.layout, self.training).memory.total
        return self.cluster.costs.activations(self.model, self.layout, "bf16").layer

    @property
    def agrees(self) -> bool:
        if self.kind == "reserved peak":
            return self.planner() <= self.published
        return abs(self.planner() / self.published - 1) <= self.tolerance

    @property
    def verdict(self) -> str:
        if self.kind == "reserved peak":
            return "under the reservation, as allocated bytes must be" if self.agrees else "OVER THE RESERVATION"
        return "agrees" if self.agrees else "DISAGREES"


# ---- Rajbhandari et al. 2020 (ZeRO), Figure 1 ---------------------------------------------------------------
# Per-device model states of a Ψ = 7.5B model under data parallelism of Nd = 64 with mixed-precision Adam (K = 12):
# baseline (2 + 2 + K)Ψ = 120GB, P_os 4Ψ + KΨ/Nd = 31.4GB, P_os+g 2Ψ + (2 + K)Ψ/Nd = 16.6GB, P_os+g+p
# (2 + 2 + K)Ψ/Nd = 1.9GB (the figure and its caption, as quoted in text by several notes on the paper).
# ZeRO counts 2-byte (fp16) gradients (§3.1: "an fp16 copy of the parameters and the gradients"): checked with
# Training.grad_dtype = "fp16" (plait's own runtime keeps 4-byte fp32 accumulators).
ZERO_WHERE = "Rajbhandari et al. 2020 (ZeRO, SC'20), Figure 1 and caption (Psi = 7.5B, K = 12, Nd = 64)"
ZERO_FIGURES = ((0, "baseline", "120GB", 120e9), (1, "P_os", "31.4GB", 31.4e9), (2, "P_os+g", "16.6GB", 16.6e9),
                (3, "P_os+g+p", "1.9GB", 1.9e9))


def _zero() -> list[ByteFigure]:
    m = gpt(32, 4096, 32, name="gpt-6.7b")  # any model: model-state bytes scale with the parameter count
    return [ByteFigure("Rajbhandari et al. 2020 (ZeRO)", ZERO_WHERE, f"7.5B parameters, DP 64, {stage}",
                       "model states", printed, value, m, Layout(dp=64, zero=zero), Cluster("a100-80gb", 64),
                       params=7.5e9, tolerance=0.03 if zero == 3 else 0.02,
                       training=Training(64, grad_dtype="fp16"))
            for zero, stage, printed, value in ZERO_FIGURES]


# ---- Korthikanti et al. 2022, Section 4 -------------------------------------------------------------------------
# Activation bytes per transformer layer (16-bit, dropout, MHA, 4h GELU MLP; s sequence, b micro-batch, h hidden,
# a heads, t tensor-parallel size): sbh(34 + 5as/h) without parallelism; sbh(10 + 24/t + 5as/(ht)) with tensor
# parallelism; sbh(34/t + 5as/(ht)) with tensor and sequence parallelism; selective recomputation drops the 5as/h
# term; full recomputation keeps the layer input, 2sbh. Evaluated for GPT-3 175B (s = 2048, b = 1, h = 12288,
# a = 96) at t = 8 on an unfused (non-flash) attention, as the paper's runs had.
KORTHIKANTI_WHERE = ("Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models "
                     "(arXiv 2205.05198), Section 4 (activation memory per layer, by technique)")
# (label, formula as printed, tp, sequence parallel, recompute)
KORTHIKANTI_FORMULAS = (
    ("no parallelism", "sbh(34 + 5as/h)", 1, False, "none"),
    ("tensor parallel", "sbh(10 + 24/t + 5as/(ht))", 8, False, "none"),
    ("tensor + sequence parallel", "sbh(34/t + 5as/(ht))", 8, True, "none"),
    ("tensor parallel + selective recompute", "sbh(10 + 24/t)", 8, False, "selective"),
    ("tensor + sequence parallel + selective recompute", "sbh(34/t)", 8, True, "selective"),
    ("full recompute", "sbh(2)", 8, False, "full"),
)


def korthikanti_bytes(formula: str, s: int, b: int, h: int, a: int, t: int) -> float:
    """One of the paper's per-layer formulas evaluated (its terms spelt as printed)."""
    sbh = s * b * h
    score = 5 * a * s / h
    body = {"sbh(34 + 5as/h)": 34 + score, "sbh(10 + 24/t + 5as/(ht))": 10 + 24 / t + score / t,
            "sbh(34/t + 5as/(ht))": 34 / t + score / t, "sbh(10 + 24/t)": 10 + 24 / t,
            "sbh(34/t)": 34 / t, "sbh(2)": 2}[formula]
    return sbh * body


def _korthikanti() -> list[ByteFigure]:
    m = gpt(96, 12288, 96, name="gpt3-175b")
    out = []
    for label, formula, t, sp, rc in KORTHIKANTI_FORMULAS:
        value = korthikanti_bytes(formula, m.seq_len, 1, m.hidden, m.n_heads, t)
        out.append(ByteFigure("Korthikanti et al. 2022", KORTHIKANTI_WHERE, f"GPT-3 175B layer, {label}",
                              "layer activations", formula, value, m,
                              Layout(tp=t, dp=8 // t, sequence_parallel=sp, recompute=rc),
                              Cluster("a100-80gb", 8, flash_attention=False), tolerance=1e-9))
    return out


# ---- torchtitan, Llama 3.1 8B on H100 (measured peak memory) -----------------------------------------------------
# pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bfd): Tables 1 and 3, "FSDP" rows
# (bf16, no torch.compile, no Float8): Llama 3.1 8B, local batch size 2, selective activation checkpointing,
# Memory(GiB) 82.4 on 8 GPUs and 67.0 on 128 ("the maximum across all GPUs"; H100 96GB HBM2e). The torchtitan
# commit it names (9dec370) trains the 8B config at seq_len 8192 with selective_ac_option 'op'
# (train_configs/llama3_8b.toml): each block keeps its input, every other matmul's output and the flash
# attention's (``Training.selective_policy = "torchtitan-op"``, ``plan.memory.torchtitan_op_layer``); its train.py
# computes the loss as cross_entropy(pred.float(), labels) (``Training.loss = "torch-cross-entropy"``). The two
# rows differ by the sharded model states alone. Memory(GiB) is the caching allocator's reserved peak (train.py at
# 9dec370 logs device_mem_stats.max_reserved_gib, torchtitan/metrics.py's "reserved_bytes.all.peak"): it bounds the
# allocated peak the planner counts from above; the allocated peak is not printed. FSDP2 as torchtitan wraps it
# (``Training.zero3_impl = "torchtitan-fsdp2"``): the root group and the last block stay gathered through the
# loss's backward, and no gradient shard exists then (``plan.memory.fsdp2_working``, ``rank_memory``).
TITAN_H100_WHERE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bfd), Table {table}"
TITAN_H100_ROWS = ((1, 8, "82.4"), (3, 128, "67.0"))  # table, GPUs, Memory(GiB) as printed


def _titan_h100() -> list[ByteFigure]:
    m = Model.preset("llama3-8b")
    return [ByteFigure("torchtitan", TITAN_H100_WHERE.format(table=table), f"Llama 3.1 8B FSDP on {n} H100, "
                       "local batch 2, reserved peak", "reserved peak", f"Memory(GiB) {gib}", float(gib) * 2**30,
                       m, Layout(dp=n, microbatch_size=2, recompute="selective", zero=3), Cluster("h100-sxm", n),
                       training=Training(2 * n, selective_policy="torchtitan-op", loss="torch-cross-entropy",
                                         zero3_impl="torchtitan-fsdp2"))
            for table, n, gib in TITAN_H100_ROWS]


# ---- NVIDIA DGX Cloud Benchmarking, Nemotron-4 15B (a logged step) -------------------------------------------------
# nemotron/README.md (commit 741c8860) shows the log line of its BF16 example, Nemotron-4 15B on 64 H100 (GBS 256,
# "training step time = 2.693 s"; TP2, MBS 2 from the layout table): "peak_memory_usage: 72972500992 |
# memory_allocated: 34466545664". After the step only the model states are allocated: 2 B weights, 2 B gradients
# and 12 B of distributed-optimizer state over DP 32 per parameter on a GPU come to 34.2 GB: NeMo's performance
# recipes keep and reduce gradients in bf16 (``plan.published_h100.DGXC_GRADS``). The peak is the caching
# allocator's reservation (NVIDIA/NeMo nemo/lightning/pytorch/strategies/megatron_strategy.py at d2b21556 logs
# the CUDA allocator's max_memory_reserved() as peak_memory_usage, its memory_allocated() as memory_allocated): it
# bounds the allocated peak the planner counts from above, and the two agree only within the allocator's slack.
NEMOTRON_LOG_WHERE = "NVIDIA/dgxc-benchmarking nemotron/README.md (commit 741c8860), the BF16 example's log line"
# The loss of the v25.04 NeMo 2.0 runs: nemotron/setup.sh and llama3.1/setup.sh at 741c8860 install NeMo d2b21556
# over Megatron-Core ee6737da, whose GPTModel computes Megatron-Core's vocab-parallel cross-entropy (NeMo's
# GPTConfig and Nemotron4Config set cross_entropy_loss_fusion = True: its 'native' fusion, the same bytes):
# ``Training.loss = "megatron-vocab-parallel"``. The v24.11.1 rows and the GPT-3 175B container pin no
# Megatron-Core commit: Korthikanti et al.'s count.
DGXC_LOSS = "megatron-vocab-parallel"
DGXC_LOSS_MODELS = ("llama3-8b", "nemotron4-15b")


def _nemotron_log() -> list[ByteFigure]:
    m = dgxc_model("nemotron4-15b")
    layout = Layout(tp=2, dp=32, microbatch_size=2, sequence_parallel=True, zero=1)
    cluster = Cluster("h100-sxm", 64)
    label, training = "Nemotron-4 15B, TP2 DP32, 64 H100", Training(256, grad_dtype=DGXC_GRADS, loss=DGXC_LOSS)
    return [ByteFigure("NVIDIA DGX Cloud Benchmarking", NEMOTRON_LOG_WHERE, f"{label}, after the step",
                       "model states", "memory_allocated: 34466545664", 34466545664.0, m, layout, cluster,
                       tolerance=0.05, training=training),
            ByteFigure("NVIDIA DGX Cloud Benchmarking", NEMOTRON_LOG_WHERE, f"{label}, reserved peak",
                       "reserved peak", "peak_memory_usage: 72972500992", 72972500992.0, m, layout, cluster,
                       training=training)]


def byte_figures() -> list[ByteFigure]:
    """Every published byte count the memory model is checked against."""
    return _zero() + _korthikanti() + _titan_h100() + _nemotron_log()


# ---- Statements that a published layout fitted ---------------------------------------------------------------
# Meta (Llama 3), §3.3.2: "With these optimizations, we could pre-train Llama 3 on sequences of 8K tokens without
# activation checkpointing" (Table 4's 8K rows; their pipeline schedule with a tunable number of micro-batches per
# round and tensors freed early, which plait's interleaved 1F1B does not model). NVIDIA DGX Cloud Benchmarking
# READMEs: "Training of this ...-billion parameter variant of the workload will not fit on fewer GPUs with less
# memory" beside the smallest scale of each model's layout table (H100 80GB, BF16).
DGXC_V24_WHERE = "NVIDIA/dgxc-benchmarking {path} (commit 35a9aecc, v24.11.1), minimum scale and layout"
# Context parallelism as the runs (``plan.published_h100``): Megatron-Core's default p2p ring, plait's "ring", which
# keeps no other rank's K and V. Gradients bf16 in both releases: v24.11.1's llama3.1/llama3.1_{8b,70b,405b}.yaml
# run distributed_fused_adam with optim.grad_sync_dtype: bf16 (its bf16 gradient buffer); v25.04's as
# ``plan.published_h100.DGXC_GRADS``.
# (model, where, GPUs, TP, PP, CP, VP, GBS, the statement as printed)
DGXC_FITS = (
    ("llama3-8b", DGXC_WHERE.format(path="llama3.1/README.md", table="minimum scale and layout table"),
     8, 1, 1, 2, 1, 128, "The training of smaller 8-billion parameter variant of the workload will not fit on "
     "fewer GPUs with lesser memory"),
    ("gpt3-175b", DGXC_WHERE.format(path="nemo_megatron/README_175b.md", table="minimum scale and layout table"),
     128, 4, 8, 1, 6, 256, "At least 128 GPUs with at least 80 GB memory each. Training of this 175-billion "
     "parameter variant of the workload will not fit on fewer GPUs with less memory."),
    ("nemotron4-15b", DGXC_WHERE.format(path="nemotron/README.md", table="minimum scale and layout table"),
     16, 2, 1, 1, 1, 64, "This variant of the workload is best-suited for GPU clusters with at least 16x H100 GPUs "
     "with 80 GB memory. Training of smaller 15-billion parameter variant of the workload will not fit on fewer "
     "GPUs with lesser memory."),
    ("llama3-70b", DGXC_V24_WHERE.format(path="llama3.1/README_70b.md"), 64, 4, 4, 2, 5, 128,
     "At least 64 GPUs with at least 80 GB memory each. Training of this 70-billion parameter variant of the "
     "workload will not fit on fewer GPUs with less memory."),
    ("llama3-405b", DGXC_V24_WHERE.format(path="llama3.1/README_405b.md"), 576, 8, 9, 2, 7, 252,
     "At least 576 GPUs with at least 80 GB memory each. Training of this 405-billion parameter variant of the "
     "workload will not fit on fewer GPUs with less memory."),
)


# BigScience's topology search before BLOOM (``plan.published_bloom.BLOOM_PREQUEL``): each layout's Mem ("max memory
# used", of 77GB usable on an A100 80GB) or OOM.
# MosaicML llm-foundry's benchmark tables (scripts/train/benchmarking/README.md) list the configurations that ran:
# each row's micro-batch under FSDP FULL_SHARD fitted its GPUs' 80 GB (FSDP reduce-scatters every micro-batch's
# gradients and keeps shards, as plait's ZeRO-3 does: ``plan.memory.rank_memory``).
MOSAIC_SOURCE = "MosaicML llm-foundry"


def fit_statements() -> list[MemoryStatement]:
    """Published statements that a layout fitted, beyond Narayanan et al.'s (``plan.published``)."""
    out = []
    llama = Model.preset("llama3-405b")
    for n, dp, per_dp, *_ in META_ROWS:
        out.append(MemoryStatement(
            "Meta (Llama 3)", META_WHERE + "; Section 3.3.2 (pipeline parallelism improvements)",
            f"Llama 3 405B, TP{META_TP} PP{META_PP} DP{dp}, 8K tokens, no activation checkpointing, {n} H100", llama,
            Cluster("h100-sxm", n, interconnect="roce-400"),
            Layout(tp=META_TP, pp=META_PP, dp=dp, virtual_stages=META_V, schedule="interleaved-1f1b",
                   sequence_parallel=True, zero=1),
            Training(dp * per_dp), True, "we could pre-train Llama 3 on sequences of 8K tokens without activation "
            "checkpointing"))
    for name, where, n, tp, pp, cp, vp, gbs, printed in DGXC_FITS:
        mbs = next(row[7] for row in DGXC_ROWS if row[0] == name)
        m = dgxc_model(name)
        out.append(MemoryStatement(
            "NVIDIA DGX Cloud Benchmarking", where, f"{m.name} TP{tp} PP{pp} CP{cp} VP{vp} on {n} H100 80GB", m,
            Cluster("h100-sxm", n),
            Layout(tp=tp, pp=pp, cp=cp, cp_comm="ring", dp=n // (tp * pp * cp), virtual_stages=vp,
                   microbatch_size=mbs, schedule="interleaved-1f1b" if vp > 1 else "1f1b", sequence_parallel=tp > 1,
                   zero=1),
            Training(gbs, grad_dtype=DGXC_GRADS, loss=DGXC_LOSS if name in DGXC_LOSS_MODELS else "fp32-logits"),
            True, printed))
    bloom = bloom_model(72, 64)
    for dp, tp, pp, mbs, gbs, mem, *_ in BLOOM_PREQUEL:
        n = dp * tp * pp
        out.append(MemoryStatement(
            "BigScience (BLOOM)", BLOOM_PREQUEL_WHERE, f"BLOOM 181B dp{dp} tp{tp} pp{pp} mbs{mbs} on {n} A100 80GB",
            bloom, Cluster("a100-80gb", n, interconnect=OMNIPATH, flash_attention=False),
            bloom_prequel_layout(dp, tp, pp, mbs), Training(gbs, grad_dtype=BLOOM_PREQUEL_GRADS), mem != "OOM",
            f"Mem {mem}" if mem != "GB" else "Mem GB (not read; Sec/it printed: it ran)"))
    for r in runs():
        if r.source == MOSAIC_SOURCE:
            out.append(MemoryStatement(r.source, r.where, f"{r.label}, micro-batch {r.layout.microbatch_size}, "
                                       f"{'full' if r.layout.recompute == 'full' else 'no'} activation checkpointing",
                                       r.model, r.cluster, r.layout, r.training, True,
                                       f"{r.figure} (a row of the table: the configuration ran)"))
    return out


def format_byte_figures(figures: list[ByteFigure] | None = None) -> str:
    """One line per published byte count: printed, the planner's, and whether they agree."""
    lines = []
    for f in figures if figures is not None else byte_figures():
        p = f.planner()
        lines.append(f"{f.label}: published {f.printed} = {f.published / 1e9:.3f} GB; planner {p / 1e9:.3f} GB "
                     f"({100 * (p / f.published - 1):+.1f}%) -> {f.verdict} ({f.where})")
    return "\n".join(lines)
