"""Published H100 training runs (2024-2025): NVIDIA's DGX Cloud benchmarking recipes.

Part of the public evaluation set (``plan.published``, where ``PublishedRun`` and the rule live: only figures read
in a public text, each with where it is printed and how the step time follows from it).
"""

from __future__ import annotations

from plait.plan.cluster import Cluster
from plait.plan.config import Layout, Training
from plait.plan.model import Model
from plait.plan.published import PublishedRun, gpt

# ---- NVIDIA DGX Cloud Benchmarking recipes (H100 80GB, BF16) ------------------------------------------------
# NVIDIA/dgxc-benchmarking at release v25.04 (commit 741c8860): llama3.1/README.md prints per model a layout table
# (GPUs, SeqLen, Layers, TP, PP, CP, DP, VP, MBS, GBS, GA) and a "Training step time (seconds per step)" row per
# GPU count for BF16 and FP8 on H100; nemo_megatron/README_175b.md the same for GPT-3 175B, whose launch config
# nemo_megatron/cfg/gpt3_175b_hydra.yaml (same commit) says: sequence_parallel true, activations_checkpoint_*
# null, distributed_fused_adam, make_vocab_size_divisible_by 128, GPT2BPETokenizer. Only the BF16 rows go in
# (plait's training model has no FP8). The Llama rows run NeMo 2.0's llama31 recipes (llama3.1/pretrain_llama31.py,
# the HF tokenizer); their sequence parallelism and distributed optimizer are the recipes' defaults (NVIDIA/NeMo
# nemo/collections/llm/recipes/llama31_405b.py: sequence_parallelism=True, distributed_fused_adam), not printed
# in the benchmark's own text. The 405B proxy rows (fewer layers) stay out.
DGXC_COMMIT = "741c886025a7665a1d690c05ff12ac29c1be7252"
DGXC_WHERE = "NVIDIA/dgxc-benchmarking {path} (commit 741c8860, v25.04), {table}"
# (model, README, GPUs, TP, PP, CP, VP or 0, GBS, step seconds and model flops utilization as printed)
DGXC_ROWS = (
    ("gpt3-175b", "nemo_megatron/README_175b.md", 128, 4, 8, 1, 6, 256, "8.309", "53.54%"),
    ("gpt3-175b", "nemo_megatron/README_175b.md", 512, 4, 8, 1, 6, 1024, "8.42", "52.84%"),
    ("gpt3-175b", "nemo_megatron/README_175b.md", 2048, 4, 8, 1, 6, 4096, "8.49", "52.40%"),
    ("llama3-8b", "llama3.1/README.md", 8, 1, 1, 2, 0, 128, "12.27", "62.47%"),
    ("llama3-8b", "llama3.1/README.md", 128, 1, 1, 2, 0, 2048, "12.33", "62.16%"),
    ("llama3-70b", "llama3.1/README.md", 64, 4, 4, 2, 5, 128, "14.66", "54.32%"),
    ("llama3-70b", "llama3.1/README.md", 512, 4, 4, 2, 5, 1024, "14.67", "54.29%"),
    ("llama3-70b", "llama3.1/README.md", 2048, 4, 4, 2, 5, 4096, "14.66", "54.32%"),
    ("llama3-405b", "llama3.1/README.md", 512, 8, 8, 2, 8, 256, "19.78", "55.47%"),
    ("llama3-405b", "llama3.1/README.md", 1024, 8, 8, 2, 8, 512, "19.84", "55.31%"),
    ("llama3-405b", "llama3.1/README.md", 2048, 8, 8, 2, 8, 1024, "19.87", "55.22%"),
)
DGXC_TABLES = {"gpt3-175b": "NeMo Megatron BF16", "llama3-8b": "Llama 3.1 8b BF16",
               "llama3-70b": "Llama 3.1 70b BF16", "llama3-405b": "Llama 3.1 405b BF16"}


def dgxc_model(name: str) -> Model:
    """The model a DGX Cloud recipe trains: GPT-3 175B with the GPT-2 BPE vocabulary (50,257 padded to a multiple
    of 128·TP = 512: 50,688), or the Llama 3.1 shapes (plait's presets, Llama 3's Table 3)."""
    if name == "gpt3-175b":
        return gpt(96, 12288, 96, vocab=50688, name="gpt3-175b")
    return Model.preset(name)


def _dgx_cloud() -> list[PublishedRun]:
    out = []
    for name, path, n, tp, pp, cp, vp, gbs, step, mfu in DGXC_ROWS:
        m = dgxc_model(name)
        layout = Layout(tp=tp, pp=pp, cp=cp, dp=n // (tp * pp * cp), virtual_stages=vp or 1,
                        schedule="interleaved-1f1b" if vp else "1f1b", microbatch_size=1,
                        sequence_parallel=tp > 1, zero=1)
        out.append(PublishedRun(
            "NVIDIA DGX Cloud Benchmarking", DGXC_WHERE.format(path=path, table=DGXC_TABLES[name]),
            f"{m.name} on {n} H100, BF16", m, Cluster("h100-sxm", n), layout, Training(gbs),
            f"Training step time (seconds per step) {step} (Model flops utilization {mfu})", float(step),
            "printed step time",
            ("fabric not printed: NDR InfiniBand assumed (DGX H100)", "distributed fused Adam costed as ZeRO-1",
             "no recomputation (none configured)", "sequence parallelism with TP (the recipes' default)",
             "TP communication overlap (userbuffers) not modelled as such", "Transformer Engine fused attention")))
    return out


def runs() -> list[PublishedRun]:
    """The H100 sources of the evaluation set."""
    return _dgx_cloud()
