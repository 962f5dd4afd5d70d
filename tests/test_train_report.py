"""The end-of-run memory table of plait train, as a terminal or a log file 80 columns wide shows it."""

from __future__ import annotations

import pytest
from rich.console import Console

from plait.train.memory_table import memory_table

MB = 2**20


def _render(rows: list[dict], predicted: list[dict] | None) -> list[str]:
    console = Console(record=True, width=80, force_terminal=False)
    console.print(memory_table(rows, predicted))
    return console.export_text().splitlines()


@pytest.mark.parametrize("zero3", [False, True])
def test_the_memory_table_reads_one_number_a_cell_in_80_columns(zero3):
    kinds = {"params": 1234.56, "grads": 1234.56, "optimizer": 2469.12, "activations_peak": 12.95}
    if zero3:
        kinds["params_gathered_peak"] = 321.5
    rows = [{"rank": r, "pp": r // 2, "dp": 0, "tp": r % 2, **{k: v * MB for k, v in kinds.items()}}
            for r in range(4)]
    predicted = [{"pp_rank": pp, **{k: (v + 1) * MB for k, v in kinds.items()}} for pp in range(2)]
    lines = _render(rows, predicted)
    text = "\n".join(lines)
    assert all(len(line) <= 80 for line in lines), text
    assert "…" not in text and "activations" in text and ("gathered" in text) == zero3, text
    measured = [f"{v:.2f}" for v in kinds.values()] + [f"{sum(kinds.values()):.2f}"]
    forecast = [f"{v + 1:.2f}" for v in kinds.values()] + [f"{sum(kinds.values()) + len(kinds):.2f}"]
    for r in range(4):  # each rank's numbers on one line, the prediction for its stage on the next
        at = next(i for i, line in enumerate(lines) if line.split()[:2] == [str(r), f"{r // 2}/0/{r % 2}"])
        assert lines[at].split()[2:] == measured, text
        assert lines[at + 1].split() == ["predicted", *forecast], text


def test_without_a_prediction_the_table_says_it_is_measured_alone():
    rows = [{"rank": 0, "pp": 0, "dp": 0, "tp": 0, "params": MB, "grads": MB, "optimizer": 2 * MB,
             "activations_peak": MB}]
    lines = _render(rows, None)
    assert lines[0] == "memory per rank, MiB (measured)"
    assert "predicted" not in "\n".join(lines) and lines[-1].split() == ["0", "0/0/0", "1.00", "1.00", "2.00", "1.00",
                                                                         "5.00"]


def test_under_context_parallelism_each_rank_is_told_apart_by_its_cp_coordinate():
    rows = [{"rank": r, "pp": 0, "dp": r // 2, "cp": r % 2, "tp": 0, "params": MB, "grads": MB, "optimizer": 2 * MB,
             "activations_peak": MB} for r in range(4)]
    lines = _render(rows, None)
    assert lines[2].split()[:2] == ["rank", "pp/dp/cp/tp"], "\n".join(lines)
    assert [line.split()[1] for line in lines[4:]] == ["0/0/0/0", "0/0/1/0", "0/1/0/0", "0/1/1/0"], "\n".join(lines)


def test_the_layout_line_names_the_zero_stage_expert_parallelism_and_bf16():
    from plait.parallel_config import ParallelConfig
    from plait.train.report import layout_text

    assert layout_text(ParallelConfig(tp=1, pp=1, dp=2, microbatches=1, zero=3)) == \
        "tp 1 x pp 1 x dp 2 (2 processes), 1 micro-batch, ZeRO-3"  # the run said nothing of its ZeRO stage
    assert layout_text(ParallelConfig(tp=1, pp=1, dp=2, microbatches=2, ep=2, zero=1, precision="bf16")) == \
        "tp 1 x pp 1 x dp 2 (2 processes), 2 micro-batches, ep 2, ZeRO-1, bf16"
    assert layout_text(ParallelConfig(tp=2, pp=1, dp=2, microbatches=1, ep=2, expert_tp=True)) == \
        "tp 2 x pp 1 x dp 2 (4 processes), 1 micro-batch, ep 2, expert TP"  # the experts' split was not said
    assert layout_text(ParallelConfig(tp=1, pp=1, dp=1, microbatches=1)) == \
        "tp 1 x pp 1 x dp 1 (1 process), 1 micro-batch"


def test_a_step_line_in_a_log_is_one_line_whatever_its_length():
    """Without a terminal rank 0 prints a line every tenth of the run; at 80 columns one with its bubble was cut
    ('... | 277 ms (predicted 375) | bubble 21% ' and '(predicted 22%)' on the next line)."""
    from plait.train.config import TrainConfig
    from plait.train.report import Reporter

    console = Console(record=True, width=80, force_terminal=False)
    reporter = Reporter(TrainConfig(metrics=None, steps=10), 0, console)
    row = {"step": 10, "loss": 4.075, "tokens_per_s": 3700.0, "step_time_s": 0.277, "predicted_step_time_s": 0.375,
           "measured_bubble": 0.21, "predicted_bubble": 0.22}
    reporter.step(row)
    assert console.export_text().splitlines() == [
        "step    10/10 | loss 4.075 | 3,700 tok/s | 277 ms (predicted 375) | bubble 21% (predicted 22%)"]


def test_the_throughput_row_writes_its_median_step_as_the_step_time_row_does():
    from types import SimpleNamespace

    from plait.train.report import _throughput

    res = SimpleNamespace(tokens_per_s=474.2, step_time_s=8.649)  # a 2,048-token step on one CPU process
    assert _throughput(res) == "474 tokens/s (median step 8,649 ms)"  # was '8649 ms' beside 'measured 8,649 ms'


def test_an_moe_run_s_memory_prediction_says_it_counts_the_mean_routing():
    """Under expert parallelism a step's routing decides which rank's experts receive the rows: the prediction
    counts balanced routing's (the mean), so its memory table says so under the figures, with the most a rank's
    experts can receive (tiny with 4 experts, top-2, at dp4 ep2: 2x); a dense run and an MoE run without EP say
    nothing."""
    from plait.cli.predict import memory_notes, predict
    from plait.train import TrainConfig
    from profile_util import synthetic_profile

    def notes(**fields) -> list[str]:
        cfg = TrainConfig.from_dict(dict(model="tiny", seq_len=128, batch_size=8, tp=1, pp=1, dp=4, **fields))
        return memory_notes(predict(cfg, synthetic_profile(counts=(4,)), 4))

    (note,) = notes(experts=4, top_k=2, ep=2)
    assert note.startswith("MoE: each rank's experts are predicted at 1× balanced routing's rows, the mean over the "
                           "EP group; a step's routing sends some ranks more and others less, up to 2× "), note
    assert notes() == [] and notes(experts=4, top_k=2) == []
    rows = [{"rank": 0, "pp": 0, "dp": 0, "tp": 0, "params": MB, "grads": MB, "optimizer": 2 * MB,
             "activations_peak": MB}]
    console = Console(record=True, width=80, force_terminal=False)
    console.print(memory_table(rows, [{"pp_rank": 0, "params": MB}], [note]))
    assert "note: " + note in " ".join(console.export_text().split()), console.export_text()


def test_a_pipeline_s_bubble_says_why_it_was_not_measured():
    """A pipelined run shorter than --trace-every (plait plan's layout run for 6 steps) printed the predicted bubble
    alone, with no word of why none was measured beside it; it now says which steps --trace-every traces."""
    from types import SimpleNamespace

    from plait.train.report import _bubbles

    pred = SimpleNamespace(bubble=0.052)
    untraced = SimpleNamespace(measured_bubble=None, simulated_bubble=None)
    assert _bubbles(untraced, pred, 10) == ("predicted 5.2% (idle share of the step); not measured: --trace-every 10 "
                                            "traces steps 10, 20, ...: this run reached none of them")
    assert _bubbles(untraced, None, 0) == "- (not measured: --trace-every 0 traces no step)"
    assert _bubbles(untraced, pred, None) == "predicted 5.2% (idle share of the step)"  # no pipeline: nothing to trace
    traced = SimpleNamespace(measured_bubble=0.061, simulated_bubble=0.055)
    assert _bubbles(traced, pred, 10) == ("measured 6.1%, simulated from its costs 5.5%, predicted 5.2% (idle share "
                                          "of the step)")
