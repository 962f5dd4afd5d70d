"""plait as a library in the user's own script: docs/library.md's scripts print what the page shows, and what
plait refuses and how (checks_library, run in the shared launch of 4 ranks)."""

from __future__ import annotations

import re

import pytest

from checks_library import WAIT_S, doc_scripts
from harness import result

SCRIPTS = doc_scripts()
NUMBER = re.compile(r"-?\d+\.\d+")
#: a refusal "at once": a rank that waited on a peer instead fails after WAIT_S; well under it, as other jobs on the
#: cores can hold a rank of the shared 4-rank launch off a core for a second or more
AT_ONCE_S = WAIT_S / 2


def test_the_page_shows_its_scripts():
    assert [name for name, _, _ in SCRIPTS] == ["train.py", "resume.py", "mlp.py", "errors.py"]


@pytest.mark.parametrize("name,shown", [(name, shown) for name, _, shown in SCRIPTS], ids=[n for n, _, _ in SCRIPTS])
def test_each_script_of_the_page_prints_what_it_shows(world4, name, shown):
    """Rank 0 prints the lines shown (numbers printed with 4 decimals within 1e-3, as another machine's float
    rounding may move the last digit), the other ranks nothing."""
    printed = result(world4, f"docs: {name}")
    assert NUMBER.sub("#", printed[0]) == NUMBER.sub("#", shown), f"{name} printed:\n{printed[0]}"
    for got, want in zip(NUMBER.findall(printed[0]), NUMBER.findall(shown), strict=True):
        assert abs(float(got) - float(want)) <= 1e-3 * max(1.0, abs(float(want))), (name, got, want)
    assert printed[1:] == ["", "", ""], printed

# world4: tests/conftest.py (one launch of 4 ranks shared with the other world-4 modules runs checks_library)


@pytest.mark.parametrize("attempt,shown", [("outside", "inputs contain token ids outside the vocabulary [0, 64)"),
                                           ("floats", "inputs (4, 8) torch.float32: a language model takes integer"),
                                           ("one row", "inputs (8,) torch.int64: a language model takes integer")])
def test_a_bad_evaluation_batch_is_refused_on_every_rank(world4, attempt, shown):
    """Each rank names the batch at once (a ConfigError before any collective): no stage waits on a peer that
    failed, and ids outside the vocabulary never reach the vocabulary-parallel embedding, which would give them
    zero vectors and logits of no token."""
    for rank, r in enumerate(result(world4, "bad_eval_batch")):
        kind, message, seconds = r[attempt]
        assert kind == "ConfigError" and shown in message, (rank, r[attempt])
        assert seconds < AT_ONCE_S, (rank, r[attempt])
        assert r["after"] == (4, 8, 64), (rank, r)


@pytest.mark.parametrize("call", ["train_step", "eval_step", "full_state_dict", "generate"])
def test_a_model_whose_context_is_closed_is_refused_on_every_rank(world4, call):
    """Not only the ranks that happen to reach a destroyed group first (mid-step: the others then waited on
    them): every rank, at once, names the closed context."""
    for rank, r in enumerate(result(world4, "closed_context")):
        kind, message, seconds = r[call]
        assert kind == "ConfigError" and "is closed" in message and "plait.init" in message, (rank, r[call])
        assert seconds < AT_ONCE_S, (rank, r[call])


def test_a_refused_parallelize_leaves_the_model_as_it_was(world4):
    """A partition or a number of pipeline chunks that does not fit is refused before the model is sharded in
    place: the same model then parallelizes with settings that fit and trains as one device would (had the first
    attempt sharded it, the second would find its layers already split)."""
    for rank, r in enumerate(result(world4, "refused_then_right")):
        assert r["partition"][0] == "ConfigError" and "partition=[2, 1]" in r["partition"][1], (rank, r)
        assert r["chunks"][0] == "ConfigError" and "pp*virtual_stages=4 chunks" in r["chunks"][1], (rank, r)
        assert abs(r["loss"] - r["one device"]) <= 1e-5 * r["one device"], (rank, r)


@pytest.mark.parametrize("call", ["train_step", "eval_step", "stage lengths"])
def test_ranks_of_a_replica_handed_different_rows_are_refused(world4, call):
    """Rows split by global rank trained silently on a mixture that matches no batch, and rows of another length
    on another stage failed inside a kernel on one stage: the first step (and each new shape) compares the
    batches of a replica's ranks, and every rank names the difference and the fix."""
    for rank, r in enumerate(result(world4, "rows_by_rank")):
        kind, message, seconds = r[call]
        assert kind == "ConfigError", (rank, r[call])
        assert "replica 0 were handed different batches (global rank 0: inputs (4, 8)" in message, (rank, message)
        assert "split the global batch by ctx.dp_rank" in message, (rank, message)
        assert seconds < AT_ONCE_S, (rank, r[call])
        assert abs(r["loss"] - r["one device"]) <= 1e-5 * r["one device"], (rank, r)


def test_full_state_dict_of_gradients_is_whole_or_refused_under_a_zero_optimizer(world4):
    """Under a ZeRO-1 optimizer each replica keeps the sum of its own shard of the gradients only: the
    gradients full_state_dict gave were the stale rest (0.5-1 off one device's), now it says so; without ZeRO they
    are one device's."""
    for rank, r in enumerate(result(world4, "zero_grads")):
        assert r[0] < 1e-4, (rank, r)
        said = r[1]
        assert isinstance(said, str) and said.startswith("full_state_dict(grads=True) with a ZeRO-1 optimizer"), r


@pytest.mark.parametrize("call", ["generate", "generate seed"])
def test_ranks_of_a_replica_handed_different_prompts_are_refused(world4, call):
    """plait.generate of a ParallelModel with a prompt (or a sampling seed) of each rank's own answered every rank
    with one rank's continuation: now every rank names the difference; the same prompt gives one device's."""
    for rank, r in enumerate(result(world4, "rows_by_rank")):
        kind, message, _ = r[call]
        assert kind == "ConfigError" and "replica 0 were handed different prompts" in message, (rank, r[call])
        assert "passes plait.generate the same prompts and settings" in message, (rank, message)
        assert r["generated"] == r["generated on one device"], (rank, r)
