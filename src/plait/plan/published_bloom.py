"""Published training runs of BigScience's BLOOM 176B and of the topology search before it.

Part of the public evaluation set (``plan.published``, where ``PublishedRun`` and the rule live: only figures read
in a public text, each with where it is printed and how the step time follows from it).
"""

from __future__ import annotations

from plait.plan.catalogue import LINK_EFFICIENCY, Link
from plait.plan.cluster import Cluster
from plait.plan.config import Layout, Training
from plait.plan.model import Model
from plait.plan.published import MEGATRON_CUT, TIED_FULL, PublishedRun

# ---- BigScience BLOOM 176B ---------------------------------------------------------------------------------
# bigscience-workshop/bigscience train/tr11-176B-ml/chronicles.md: at full global batch 2048, "iteration 12695/115311 |
# ... | elapsed time per iteration (s): 105.22 | ... | TFLOPs: 149.02"; README.md of that folder: 384 A100 80GB, TP=4
# PP=12 DP=8 MBS=2, 70 layers, hidden 14336, 112 heads, seq 2048, vocab 250,880 (padded), ALiBi, bf16, BF16_Optimizer's
# own ZeRO stage 1; tr11-176B-ml.slurm: --checkpoint-activations. Inter-node: "4 OmniPath links" per node. Gradients:
# DeepSpeed's BF16_Optimizer (ZERO_STAGE=0 with bf16 in that slurm) accumulates them in an fp32 buffer
# (microsoft/DeepSpeed deepspeed/runtime/bf16_optimizer.py at 56c52238, fp32_groups_gradients_flat) beside the bf16 ones
# and all-reduces that buffer cast to bf16 (engine.py, communication_data_type): costed as fp32 (one dtype for both; no
# memory figure of this run is checked). Its optimizer step is that BF16_Optimizer's around Megatron-DeepSpeed's apex
# FusedAdam ("deepspeed-bf16", ``plan.optimizers``; tr11-176B-ml.slurm: --optimizer adam, --clip-grad 1.0), and so is
# its gradient accumulation (update_hp_grads after every backward: "deepspeed-bf16", ``plan.accumulation``). Its
# pipeline engine all-reduces the tied embedding's whole fp32 gradient over the first and last stages (pipe/engine.py
# _exec_reduce_tied_grads). Its cut, "--pp-partition-method 'type:transformer|embedding'": "pp rank 0: [embed | 5
# transformer blocks] ... pp rank 11: [5 transformer blocks | embed]" (README.md of that folder).
BLOOM_CUT = (5,) + (6,) * 10 + (5,)
BLOOM_WHERE = ("BigScience tr11-176B-ml chronicles.md (iteration 12695) and README.md, "
               "bigscience-workshop/bigscience")
# The Omni-Path fabric as NCCL ran on those nodes: the repository's all-reduce benchmark on four of them
# (experiments/bandwidth/all_reduce_bench-a100-n4.txt, commit 358e3c8, 2022-01-28; NCCL 2.10.3, 32 ranks) logs two
# ring channels whose inter-node hops both leave a node through one HFI and enter through another ("Channel 00 :
# 7[cb000] -> 8[7000] [send] via NET/IB/3", "[receive] via NET/IB/1", the same for channel 01 and at every node
# boundary; none "/GDRDMA": no GPUDirect RDMA), and a bus bandwidth of 40.54 Gb/s (median of the 160 per-rank
# trials, quartiles 40.49-40.58): one HFI of the node's four (100 Gb/s each, README.md) carries one ring at 40.5
# Gb/s per direction. So a communicator's ring moves at most that across a node (``Link.ring_bandwidth``), and the
# node's eight GPUs, whose concurrent rings and pipeline transfers share its four HFIs, get an eighth of 4 x 40.5
# Gb/s each (a DP ring of one GPU per node, as at TP 8: half an HFI). BigScience's engineer puts the network BLOOM
# trained on at "only 140Gbps" a node (microsoft/DeepSpeed issue 2928, comment of 2023-10-05), against 162 here.
# The link figures are the measured ones over LINK_EFFICIENCY, which the collectives' formulas apply.
OMNIPATH_HFI = 40.54e9 / 8 / LINK_EFFICIENCY  # bytes/s one ring moves through one HFI, as the formulas count it
OMNIPATH = Link("Omni-Path, 4 HFIs per node (NCCL's measured 40.5 Gb/s each)", 4 * OMNIPATH_HFI / 8, 5e-6,
                ring_bandwidth=OMNIPATH_HFI)


# The same repository's train/tr11-176B-ml/chronicles-prequel.md (commit 59a90eec) records the topology search on those
# 48 nodes before the run, one early iteration per layout ("the snapshot of a single iteration (always 2nd)"): its "GBS
# Variations" tables (NLAYERS=72, NHIDDEN=14336, NHEADS=64, 02-25) print DP, TP, PP, MBS, GBS, Mem, Sec/it and TFLOPs,
# or OOM. The TFLOPs follow from Sec/it by eq. (3) with activation recomputation (Megatron-DeepSpeed's count), which the
# test checks. The GBS 1568 rows stay out: their iteration took as long as the 2048 rows'. Gradients: 16-bit. The launch
# script of that day (train/tr11-200B-ml/tr11-200B-ml.slurm at commit f658243, 2022-02-25) runs --fp16 with DeepSpeed's
# ZeRO stage 1 (bf16 disabled; the prequel's 02-21 notes: "currently can't test ZeRO_STAGE=0 on master"), whose fp16
# gradients are kept in the parameters' dtype and reduced in fp16 (deepspeed/runtime/engine.py at v0.5.10, 2022-01,
# communication_data_type: fp16 when fp16 or a ZeRO stage is on). Its optimizer step: that ZeRO-1's fp16 step around
# apex's FusedAdam (the slurm's --optimizer adam, --clip-grad 1.0, "gradient_clipping": 1.0), "deepspeed-zero-fp16"
# (``plan.optimizers``). Its ds_config sets no overlap_comm (v0.5.10's default False): ZeRO-1 registers no gradient
# hooks and autograd accumulates the fp16 gradients in param.grad ("autograd-16bit", ``plan.accumulation``). At the
# step's end that ZeRO-1 all-reduces the gradients, then all-gathers the updated partitions
# (``plan.step_end.ZERO1_ALL_REDUCE``: v0.5.10's engine turns contiguous_gradients off at stage 1).
BLOOM_PREQUEL_GRADS = "fp16"
BLOOM_PREQUEL_WHERE = ("BigScience tr11-176B-ml chronicles-prequel.md (commit 59a90eec), 'GBS Variations' "
                       "(NLAYERS=72, NHIDDEN=14336, NHEADS=64), bigscience-workshop/bigscience")
# (DP, TP, PP, MBS, GBS, Mem, Sec/it, TFLOPs as printed; Sec/it empty where it ran out of memory)
BLOOM_PREQUEL = (
    (8, 8, 6, 4, 2048, "55GB", "114.11", "141.27"), (8, 8, 6, 6, 2016, "66GB", "123.57", "128.43"),
    (4, 8, 12, 4, 2048, "49GB", "117.07", "137.70"), (4, 8, 12, 2, 2048, "GB", "128.82", "125.15"),
    (6, 8, 8, 4, 2016, "52GB", "113.16", "140.24"), (12, 8, 4, 2, 2016, "53GB", "125.52", "126.43"),
    (12, 8, 4, 4, 2016, "59GB", "114.81", "138.22"), (24, 8, 2, 1, 2016, "65GB", "145.45", "109.11"),
    (24, 8, 2, 2, 2016, "76GB", "136.13", "116.58"), (48, 8, 1, 1, 2016, "OOM", "", ""),
    (8, 4, 12, 4, 2048, "60GB", "111.89", "144.08"), (8, 4, 12, 2, 2048, "44GB", "110.48", "145.92"),
    (16, 4, 6, 4, 2048, "75GB", "117.11", "137.66"), (16, 4, 6, 2, 2048, "57GB", "111.71", "144.31"),
    (16, 2, 12, 2, 2048, "63GB", "112.50", "143.30"), (32, 2, 6, 2, 2048, "OOM", "", ""),
    (32, 2, 6, 1, 2048, "OOM", "", ""), (8, 2, 24, 1, 2048, "44GB", "119.53", "134.88"),
    (8, 2, 24, 2, 2048, "53GB", "122.75", "131.33"), (4, 4, 24, 1, 2048, "GB", "130.60", "123.44"),
)
BLOOM_ASSUMED = ("Omni-Path HFIs at the bus bandwidth NCCL measured on four of the nodes on 2022-01-28",
                 "1F1B (DeepSpeed's pipeline)", "embedding LayerNorm not costed")


def bloom_model(layers: int = 70, heads: int = 112) -> Model:
    """BLOOM's shapes (hidden 14336, vocabulary 250,880, ALiBi, LayerNorm, biases, tied embeddings) and dropout
    ("The default Megatron-LM dropout settings are inherited": train/tr11-176B-ml/README.md)."""
    return Model(layers, 14336, heads, 250880, 2048, bias=True, layernorm=True, tied_embeddings=True, dropout=True,
                 name="bloom-176b" if layers == 70 else f"bloom-{layers}x14336")


def bloom_prequel_layout(dp: int, tp: int, pp: int, mbs: int) -> Layout:
    return Layout(tp=tp, pp=pp, dp=dp, microbatch_size=mbs, recompute="full", zero=1, partition=MEGATRON_CUT)


def runs() -> list[PublishedRun]:
    """BLOOM 176B's run and the search's layouts that ran."""
    out = [PublishedRun("BigScience (BLOOM)", BLOOM_WHERE, "BLOOM 176B on 384 A100", bloom_model(),
                        Cluster("a100-80gb", 384, interconnect=OMNIPATH, flash_attention=False),
                        Layout(tp=4, pp=12, dp=8, microbatch_size=2, recompute="full", zero=1,
                               partition=BLOOM_CUT),
                        Training(2048, overlap_grad_reduce=False, recompute_head=False, optimizer="deepspeed-bf16",
                                 recompute_early_stop=False,
                                 grad_accumulation="deepspeed-bf16", tied_grad_sum=TIED_FULL),
                        "elapsed time per iteration (s): 105.22 (TFLOPs: 149.02)", 105.22, "printed step time",
                        BLOOM_ASSUMED)]
    m = bloom_model(72, 64)
    for dp, tp, pp, mbs, gbs, _, sec, tflops in BLOOM_PREQUEL:
        if sec:
            out.append(PublishedRun(
                "BigScience (BLOOM)", BLOOM_PREQUEL_WHERE, f"BLOOM 181B search: dp{dp} tp{tp} pp{pp} mbs{mbs}", m,
                Cluster("a100-80gb", dp * tp * pp, interconnect=OMNIPATH, flash_attention=False),
                bloom_prequel_layout(dp, tp, pp, mbs),
                Training(gbs, overlap_grad_reduce=False, recompute_head=False, grad_dtype=BLOOM_PREQUEL_GRADS,
                         recompute_early_stop=False,
                         optimizer="deepspeed-zero-fp16", grad_accumulation="autograd-16bit", tied_grad_sum=TIED_FULL),
                f"Sec/it {sec} (TFLOPs {tflops})", float(sec), "printed step time",
                BLOOM_ASSUMED + ("the 2nd iteration's time", "fp16 (the slurm of that day) costed as bf16; ZeRO-1")))
    return out
