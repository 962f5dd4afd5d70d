"""Published training runs the GPU time model (``plan.gpu``) is fitted on, and its errors on them."""

from __future__ import annotations

from dataclasses import dataclass

from plait.plan.cluster import Cluster
from plait.plan.config import Layout, Training
from plait.plan.estimate import estimate
from plait.plan.model import Model
from plait.plan.timing import model_flops_per_step


@dataclass(frozen=True)
class Case:
    """One published run: its model, cluster, layout and the step time its report implies."""

    source: str
    label: str
    model: Model
    cluster: Cluster
    layout: Layout
    training: Training
    published_step_s: float
    published: str  # the figure as printed

    def predicted_step_s(self) -> float:
        return estimate(self.model, self.cluster, self.layout, self.training).step_time_s

    def error(self) -> float:
        """Signed relative error of the predicted step time."""
        return self.predicted_step_s() / self.published_step_s - 1.0


def _gpt(layers: int, hidden: int, heads: int) -> Model:
    return Model(layers, hidden, heads, 51200, 2048, bias=True, layernorm=True, learned_positions=True,
                 tied_embeddings=True, name=f"gpt-{layers}x{hidden}")


def _narayanan_flops(m: Model, batch: int) -> float:
    """Narayanan et al. 2021 eq. (3): 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)), recomputation included."""
    b, s, l, h, v = batch, m.seq_len, m.n_layers, m.hidden, m.vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM" (SC'21), Table 1: (layers, hidden, heads, t, p, GPUs, batch, TFLOP/s per GPU).
NARAYANAN_TABLE1 = [
    (24, 2304, 24, 1, 1, 32, 512, 137), (30, 3072, 32, 2, 1, 64, 512, 138),
    (36, 4096, 32, 4, 1, 128, 512, 142), (40, 6144, 48, 8, 1, 256, 1024, 135),
    (48, 8192, 64, 8, 2, 512, 1536, 138), (60, 10240, 80, 8, 4, 1024, 1792, 140),
    (80, 12288, 96, 8, 8, 1536, 2304, 148), (96, 16384, 128, 8, 16, 1920, 2160, 155),
    (105, 20480, 128, 8, 35, 2520, 2520, 163), (128, 25600, 160, 8, 64, 3072, 3072, 163),
]
# Same paper, Table 2, PTD-P rows: (layers, hidden, heads, t, p, GPUs, batch, TFLOP/s per GPU).
NARAYANAN_TABLE2 = [
    (96, 12288, 96, 8, 12, 384, 1536, 153), (96, 12288, 96, 8, 12, 768, 1536, 149),
    (96, 12288, 96, 8, 12, 1536, 1536, 141), (105, 20480, 128, 8, 35, 560, 2240, 171),
    (105, 20480, 128, 8, 35, 1120, 2240, 167), (105, 20480, 128, 8, 35, 2240, 2240, 159),
]


def _megatron_2021(table: str, row: tuple) -> Case:
    layers, hidden, heads, t, p, n, batch, tflops = row
    m = _gpt(layers, hidden, heads)
    # Assumed (not printed in the table): micro-batch 1, non-interleaved 1F1B, full recomputation
    # (eq. 3 counts its extra forward), no SP/ZeRO (2021 code), gradient all-reduce after backward.
    layout = Layout(tp=t, pp=p, dp=n // (t * p), recompute="full", microbatch_size=1)
    step = _narayanan_flops(m, batch) / (n * tflops * 1e12)
    return Case(f"Narayanan et al. 2021, {table}", f"{m.n_params() / 1e9:.1f}B on {n} A100",
                m, Cluster("a100-80gb", n, interconnect="ib-hdr"), layout,
                Training(batch, overlap_grad_reduce=False), step, f"{tflops} TFLOP/s/GPU")


def _korthikanti() -> list[Case]:
    """Korthikanti et al. 2022 (abstract, §6): 530B on 2240 A100s, MFU 54.2% with SP + selective
    recomputation, 42.1% with full recomputation. Assumed: batch 2240, micro-batch 1, t=8, p=35."""
    m = _gpt(105, 20480, 128)
    out = []
    for rc, sp, mfu in (("selective", True, 0.542), ("full", False, 0.421)):
        layout = Layout(tp=8, pp=35, dp=8, sequence_parallel=sp, recompute=rc)
        step = model_flops_per_step(m, 2240) / (2240 * 312e12 * mfu)
        out.append(Case("Korthikanti et al. 2022", f"530B on 2240 A100, {rc}", m,
                        Cluster("a100-80gb", 2240, interconnect="ib-hdr"), layout,
                        Training(2240, overlap_grad_reduce=False), step, f"MFU {mfu:.1%}"))
    return out


def _llama3() -> list[Case]:
    """Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4: 405B, seq 8192, 16M tokens per step
    (2048 sequences); TP8 PP16, 430 TFLOP/s/GPU on 8,192 H100s (DP64), 400 on 16,384 (DP128).
    Assumed: interleaved 1F1B with 4 chunks per rank (~2 layers each), SP, selective recomputation,
    ZeRO-1, RoCE 400G."""
    m = Model.preset("llama3-405b")
    out = []
    for n, dp, tflops in ((8192, 64, 430), (16384, 128, 400)):
        layout = Layout(tp=8, pp=16, dp=dp, virtual_stages=4, sequence_parallel=True, recompute="selective",
                        zero=1, schedule="interleaved-1f1b")
        step = model_flops_per_step(m, 2048) / (n * tflops * 1e12)
        out.append(Case("Dubey et al. 2024 (Llama 3)", f"405B on {n} H100", m,
                        Cluster("h100-sxm", n, interconnect="roce-400"), layout, Training(2048), step,
                        f"{tflops} TFLOP/s/GPU"))
    return out


def cases() -> list[Case]:
    """All calibration cases, in the order of docs/planner.md."""
    return ([_megatron_2021("Table 1", r) for r in NARAYANAN_TABLE1]
            + [_megatron_2021("Table 2", r) for r in NARAYANAN_TABLE2] + _korthikanti() + _llama3())


def report() -> tuple[list[tuple[Case, float, float]], float]:
    """(case, predicted seconds, signed error) for every case, and the mean absolute % error."""
    rows = [(c, c.predicted_step_s(), c.error()) for c in cases()]
    return rows, 100 * sum(abs(e) for _, _, e in rows) / len(rows)
