"""The planner's predicted peak of a whole training step (``plait.plan.memory``: the model states, the activations
at their peak and what the step holds beside them, ``step_transients``) is the most bytes alive at once while
plait's runtime takes a step on a CPU: forward, loss, backward, gradient clipping and fused AdamW."""

from __future__ import annotations

import pytest
import torch

import plait
from harness import PRELOAD
from memory_util import LiveBytes
from plait.cli.predict import memory_rows
from plait.distributed.launch import run_world
from plait.models import Llama, LlamaConfig
from plait.optim import ParallelOptimizer
from plait.parallel_config import ParallelConfig
from plait.plan import Layout, Model
from plait.plan.memory import step_transients
from plait.plan.optimizers import RUNTIME_MASTERS
from plait.plan.runs import predict_train, train_layout
from profile_util import synthetic_profile

# a vocabulary large beside the layers, as a real model's is (32,000 logits a token beside a few thousand hidden)
CFG = LlamaConfig(vocab_size=4096, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=128)
ROWS = 4


def measured(precision: str, microbatches: int, tp: int = 1, pp: int = 1) -> tuple[int, dict]:
    """The most bytes of storages alive at once over plait's second step (the first made the optimizer's state),
    the parameters, gradient buffers and optimizer state it starts with counted, and ``pm.memory_report()``
    (with its pipeline rank, ``pp``)."""
    with plait.init(tp, pp, 1) as ctx:
        torch.manual_seed(0)
        pm = plait.parallelize(Llama(CFG), ctx, microbatches=microbatches, precision=precision)
        opt = ParallelOptimizer(pm, torch.optim.AdamW, lr=1e-4, precision=precision, clip=1.0, fused=True)
        tokens = torch.randint(0, CFG.vocab_size, (ROWS, CFG.max_seq_len + 1),
                               generator=torch.Generator().manual_seed(0))
        x, y = tokens[:, :-1], tokens[:, 1:]

        def step() -> None:
            pm.zero_grad()
            pm.train_step(x, y)
            opt.step()

        step()
        params = list(pm.parameters())
        state = [t for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        held = [*params, *(p.grad for p in params if p.grad is not None), *state]
        with LiveBytes(held) as meter:
            step()
        return meter.peak, {**pm.memory_report(), "pp": ctx.pp_rank}


def predicted(precision: str, microbatches: int, tp: int = 1, pp: int = 1) -> list[dict]:
    """``plait train --dry-run``'s rows of this run, one a pipeline rank (``plait.cli.predict.memory_rows``)."""
    model = Model.from_llama_config(CFG.to_dict(), CFG.max_seq_len)
    parallel = ParallelConfig(tp=tp, pp=pp, microbatches=microbatches, precision=precision).resolve(tp * pp)
    layout, training = train_layout(parallel, ROWS)
    return memory_rows(predict_train(model, synthetic_profile(counts=(tp * pp,)), layout, training))


@pytest.mark.parametrize(("precision", "microbatches"), [("fp32", 1), ("bf16", 1), ("bf16", 2)])
def test_the_predicted_step_peak_is_the_most_bytes_a_step_holds_at_once(precision, microbatches):
    """Within 1%: the parameters, gradients and AdamW's moments, the activations at their peak (the end of a
    micro-batch's forward), and beside them the bf16 weight copies (bf16) and the loss's backward (its float32
    gradient twice, and under bf16 its cast to bf16). Without these two the prediction is 28-39% short here."""
    peak, report = measured(precision, microbatches)
    (row,) = predicted(precision, microbatches)
    for kind in ("params", "grads", "optimizer", "activations_peak"):  # the kinds themselves, as measured
        assert row[kind] == pytest.approx(report[kind], rel=0.01), kind
    assert (row["weight_copies"] > 0) == (precision == "bf16") and row["loss_backward"] > 0
    assert row["total"] == pytest.approx(peak, rel=0.01), (row, peak)


def test_only_plaits_own_step_holds_the_transients():
    """Another stack's plan (its masters apart, Megatron-LM's count) adds nothing: its loss's peak is in its
    ``LOGIT_BYTES``; under ZeRO-1 plait stores bf16 weights (no copy); the loss's backward is the head's rank's
    alone and scales with the micro-batch's logits over TP."""
    model = Model.preset("tiny", seq_len=128)
    layout = Layout(tp=1, pp=1, dp=1, microbatch_size=2)
    logits = 2 * 128 * model.vocab
    copies, backward = step_transients(model, layout, model.n_layers, True, True, "bf16", RUNTIME_MASTERS)
    assert copies == 2 * model.n_params() and backward == 10 * logits
    assert step_transients(model, layout, model.n_layers, True, True, "fp32", RUNTIME_MASTERS) == (0, 8 * logits)
    assert step_transients(model, layout, model.n_layers, True, True, "bf16", "apart") == (0, 0)
    zero1 = Layout(tp=1, pp=1, dp=2, microbatch_size=2, zero=1)
    assert step_transients(model, zero1, model.n_layers, True, True, "bf16", RUNTIME_MASTERS) == (0, 10 * logits)
    tp2 = Layout(tp=2, pp=2, dp=1, microbatch_size=2)
    assert step_transients(model, tp2, 2, True, False, "bf16", RUNTIME_MASTERS)[1] == 0  # no head on this rank
    assert step_transients(model, tp2, 2, False, True, "bf16", RUNTIME_MASTERS)[1] == 10 * logits / 2


def _two_ranks() -> list[tuple[int, dict]]:
    """This rank's peak and report under tp 2, then under pp 2 (1F1B, 4 micro-batches), bf16."""
    return [measured("bf16", 1, tp=2), measured("bf16", 2, pp=2)]


def test_the_predicted_step_peak_holds_on_tensor_and_pipeline_ranks():
    """Under tp 2 each rank's peak is predicted within 1% (its vocabulary half's loss backward, its shards'
    copies). Under pp 2 (1F1B, 2 micro-batches) the last stage, where the loss's backward comes with its
    micro-batch's activations, within 1%. The first stage, which holds no head, is measured 4.6% over the
    prediction here: a layer's backward makes its own tensors (its MLP's [tokens, ffn] gradients among them)
    while the other micro-batch's activations are held, which the count leaves out (a known gap, smaller where a
    stage's activations are larger beside one layer's tensors)."""
    peaks = run_world(_two_ranks, 2, timeout_s=300, preload=PRELOAD)
    tp_rows, pp_rows = predicted("bf16", 1, tp=2), predicted("bf16", 2, pp=2)
    for (tp_peak, _), (pp_peak, pp_report) in peaks:
        assert tp_rows[0]["total"] == pytest.approx(tp_peak, rel=0.01), (tp_rows, tp_peak)
        row = pp_rows[pp_report["pp"]]
        assert row["activations_peak"] == pytest.approx(pp_report["activations_peak"], rel=0.01)
        if row["loss_backward"]:  # the last stage
            assert row["total"] == pytest.approx(pp_peak, rel=0.01), (row, pp_peak)
        else:
            assert row["total"] <= pp_peak <= 1.05 * row["total"], (row, pp_peak)


# bench/gpu_check.py's train and predict sections on one H200 (torch 2.11, 2026-11-30; docs/runtime.md's GPU table):
# a 0.6B Llama, 4 x 2048 tokens, bf16 over float32 masters, fused AdamW, one process. The caching allocator's
# peak over a whole step, and the bytes allocated as that step began.
H200_RUN = LlamaConfig(vocab_size=32000, dim=1536, n_layers=20, n_heads=12, n_kv_heads=4, ffn_dim=4096,
                       max_seq_len=2048)
H200_PEAK, H200_AT_REST = 25_451_836_416, 9_714_517_504


def test_the_h200_runs_allocator_peak_is_the_predicted_step_peak():
    """The dry run's step peak for that run, on the planner's H200, within 0.5% of the allocator's peak (0.41%:
    87.6 MB of the 103 MB over were allocated before the step began); the kinds alone were 18% below it."""
    from plait.plan.cluster import Cluster

    model = Model.from_llama_config(H200_RUN.to_dict(), 2048)
    layout, training = train_layout(ParallelConfig(microbatches=1, precision="bf16").resolve(1), 4)
    (row,) = memory_rows(predict_train(model, Cluster("h200", 1, gpus_per_node=1), layout, training))
    assert row["total"] == pytest.approx(H200_PEAK, rel=0.005)
    assert row["params"] + row["grads"] + row["optimizer"] == pytest.approx(H200_AT_REST, rel=0.01)
    assert H200_PEAK / (row["total"] - row["weight_copies"] - row["loss_backward"]) > 1.18
