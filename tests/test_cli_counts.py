"""Counts in what plait prints take their noun's number ('1 training shard', '2 micro-batches')."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

from rich.console import Console
from typer.testing import CliRunner

from plait.cli.main import app
from plait.words import counted


def test_counted_takes_the_nouns_number():
    assert counted(1, "training shard") == "1 training shard"
    assert counted(0, "training shard") == "0 training shards"
    assert counted(1200, "document") == "1,200 documents"
    assert [counted(n, "process") for n in (1, 4)] == ["1 process", "4 processes"]
    assert [counted(n, "micro-batch") for n in (1, 8)] == ["1 micro-batch", "8 micro-batches"]
    assert counted(2, "entry") == "2 entries" and counted(2, "day") == "2 days"
    assert counted(1.5, "micro-batch", "1.5") == "1.5 micro-batches" and counted(1.0, "chunk", "1") == "1 chunk"


def test_train_summary_counts_of_one():
    from plait.parallel_config import ParallelConfig
    from plait.train.report import _blocked, _no_targets, layout_text

    assert _no_targets([3]) == ("; 1 step had no target in the loss (step 3: its batch holds no assistant token; "
                                "its gradients were zero)")
    assert _no_targets([3, 5]).startswith("; 2 steps had no target in the loss (steps 3, 5: their batches hold")
    assert _blocked(SimpleNamespace(async_checkpoint=True), SimpleNamespace(checkpoint_blocked_s=[0.01])) \
        .startswith("; 1 save during the run,")
    assert layout_text(ParallelConfig(tp=1, pp=1, dp=1, microbatches=1)) == \
        "tp 1 x pp 1 x dp 1 (1 process), 1 micro-batch"


def test_raw_text_of_one_file_and_too_short_data_say_one(tmp_path):
    import pytest

    from plait.data.stream import check_length, open_data
    from plait.errors import ConfigError

    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("one file of text " * 50)
    data = open_data([str(tmp_path / "texts")], "tiny", 256, 8, 1, 0, 1)
    assert "(1 file, tokenized here:" in data.describe(), data.describe()
    with pytest.raises(ConfigError, match=r"training tokens in 1 document, but --seq-len 4096"):
        check_length(data.sources[0], 4096)


def test_simulate_with_one_micro_batch_and_one_chunk():
    res = CliRunner().invoke(app, ["simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "1",
                                   "--width", "80"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())  # the console wraps lines
    assert out.startswith("gpipe: 2 ranks x 1 chunk, 1 micro-batch; makespan"), res.output
    assert out.endswith("peak activations max 1 micro-batch"), res.output
    res = CliRunner().invoke(app, ["simulate", "--compare", "gpipe,1f1b", "--stages", "2", "--microbatches", "1"])
    assert res.exit_code == 0 and "P=2 stages, M=1 micro-batch, costs" in " ".join(res.output.split()), res.output


def test_prepare_summary_says_one_training_shard(tmp_path):
    from plait.data.prepare import prepare
    from plait.data.report import prepare_summary

    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "one document"}) + "\n")
    meta = prepare([str(tmp_path / "c.jsonl")], "bytes", tmp_path / "d", workers=1)
    out = io.StringIO()
    Console(file=out, width=200).print(prepare_summary(meta, tmp_path / "d"))
    assert any(line.endswith("; 1 training shard") for line in out.getvalue().splitlines()), \
        out.getvalue()  # was '... shards'


def test_plan_explanation_counts_of_one():
    """plait plan's notes on a search whose best runs one micro-batch and leaves one twin out."""
    r = CliRunner().invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "4", "--top", "1"])
    assert r.exit_code == 0, r.output
    assert "bubble 0.0% with 1 micro-batch\n" in r.output and "1 layout as fast as a twin" in r.output, r.output
