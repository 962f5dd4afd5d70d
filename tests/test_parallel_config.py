"""ParallelConfig: one layout type, checked once, before any collective, by every entry point that takes it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

import plait
from plait.cli.main import app
from plait.errors import ConfigError, FieldError, flag_message
from plait.parallel_config import ParallelConfig, field_docs, field_names

# every invalid combination the configuration itself can see: (keywords, world size or None, words the message names)
INVALID = [
    (dict(tp=0), None, ["tp=0", "positive"]),
    (dict(pp=-1), None, ["pp=-1"]),
    (dict(dp=0), None, ["dp=0", "-1"]),
    (dict(ep=0), None, ["ep=0"]),
    (dict(tp=True), None, ["tp=True"]),
    (dict(microbatches=0), None, ["microbatches=0"]),
    (dict(virtual_stages=0), None, ["virtual_stages=0"]),
    (dict(schedule="2f2b"), None, ["schedule='2f2b'", "zbv"]),
    (dict(schedule="1f1b", pp=2, virtual_stages=2), None, ["virtual_stages=2", "1f1b"]),
    (dict(schedule="zbv", pp=2, virtual_stages=3), None, ["virtual_stages=3"]),
    (dict(schedule="dualpipev", pp=2, microbatches=3), None, ["microbatches=3", "dualpipev"]),
    (dict(recompute="some"), None, ["recompute='some'", "none, selective, full"]),
    (dict(zero=4), None, ["zero=4", "0, 1, 2, 3"]),
    # refused by the ranks after the launch before: a split backward (zero-bubble), one chunk a rank or two
    (dict(dp=2, zero=3, schedule="zb-h1"), None, ["schedule='zb-h1'", "zero=3", "splits backwards",
                                                  "valid schedules with zero=3: 1f1b, gpipe, interleaved-1f1b, "
                                                  "looped-bfs"]),
    (dict(pp=2, dp=2, zero=3, schedule="zbv"), None, ["schedule='zbv'", "zero=3", "weight passes", "ZeRO-1 or ZeRO-2"]),
    (dict(pp=2, dp=2, zero=3, schedule="dualpipev", microbatches=4), None, ["schedule='dualpipev'", "zero=3"]),
    (dict(precision="fp16"), None, ["precision='fp16'", "fp32, bf16"]),
    (dict(sequence_parallel="yes"), None, ["sequence_parallel"]),
    (dict(expert_tp=1), None, ["expert_tp"]),
    (dict(tp=2, dp=1, ep=4), None, ["ep=4", "dp*tp=2"]),
    (dict(tp=2, dp=1, ep=2, expert_tp=True), None, ["ep=2", "dp=1", "expert_tp"]),
    (dict(tp=3), 4, ["tp*pp=3", "world size 4"]),
    (dict(tp=2, pp=1, dp=4), 4, ["tp*pp*dp", "world size is 4"]),
    (dict(tp=1, pp=1, dp=-1, ep=3), 4, ["ep=3", "dp*tp=4"]),
]


@pytest.mark.parametrize("kw,world,needles", INVALID)
def test_every_invalid_combination_is_a_config_error_naming_it(kw, world, needles):
    with pytest.raises(ConfigError) as info:
        ParallelConfig(**kw).resolve(world) if world else ParallelConfig(**kw)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_plait_init_refuses_before_any_collective():
    """In one fresh process told it is rank 0 of a world (with no rendezvous address, so any attempt to form
    the process group would fail differently): every invalid layout is a ConfigError and no group exists."""
    code = ("import json, os, sys, torch.distributed as dist, plait\n"
            "out = []\n"
            "for kw, world in json.loads(sys.argv[1]):\n"
            "    os.environ.update(RANK='0', WORLD_SIZE=str(world or 4))\n"
            "    try:\n"
            "        plait.init(config=plait.ParallelConfig(**kw), timeout_s=5)\n"
            "        out.append('no error')\n"
            "    except plait.ConfigError as exc:\n"
            "        out.append(f'ConfigError {dist.is_initialized()}')\n"
            "print(json.dumps(out))\n")
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    cases = json.dumps([[kw, world] for kw, world, _ in INVALID])
    proc = subprocess.run([sys.executable, "-c", code, cases], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == ["ConfigError False"] * len(INVALID)


def test_resolve_infers_dp_and_expert_tp_needs_tp():
    cfg = ParallelConfig(tp=2, pp=2).resolve(8)
    assert (cfg.dp, cfg.world) == (2, 8)
    assert ParallelConfig(tp=1, dp=2, ep=2, expert_tp=True).resolve(2).expert_tp is False  # nothing to split
    assert ParallelConfig(pp=4).num_microbatches == 4 and ParallelConfig(pp=4, microbatches=8).num_microbatches == 8
    assert ParallelConfig(schedule="interleaved-1f1b", pp=2, microbatches=4).pipeline_schedule().virtual == 2


def test_field_errors_read_as_flags_on_the_command_line():
    with pytest.raises(FieldError) as info:
        ParallelConfig(virtual_stages=0)
    assert flag_message(info.value).startswith("--virtual-stages 0: ")
    res = CliRunner().invoke(app, ["verify", "--schedule", "1f1b", "--virtual-stages", "2"])
    assert res.exit_code == 2 and "--virtual-stages 2: 1f1b places exactly 1 chunk" in res.output
    for command in ("train", "verify"):  # --zero reaches both; ZeRO-3 under a zero-bubble schedule says what runs
        res = CliRunner().invoke(app, [command, "--pp", "2", "--zero", "3", "--schedule", "zb-h1"])
        assert res.exit_code == 2 and res.output.startswith("error: --schedule 'zb-h1': not with --zero 3: "), \
            res.output
        assert "valid schedules with --zero 3: 1f1b, gpipe, interleaved-1f1b, looped-bfs" in res.output, res.output
    with pytest.raises(ConfigError, match=r"^schedule='zb-h1': not with zero=3: "):  # Python: the fields
        ParallelConfig(pp=2, zero=3, schedule="zb-h1")
    assert ParallelConfig(pp=2, dp=2, zero=3, schedule="gpipe").zero == 3  # a pipeline with one chunk per rank runs
    for name in ("interleaved-1f1b", "looped-bfs"):  # and with several, each backward whole
        assert ParallelConfig(pp=2, dp=2, zero=3, schedule=name, microbatches=4).zero == 3
    res = CliRunner().invoke(app, ["train", "--tp", "1", "--pp", "1", "--dp", "2", "--ep", "3"])
    assert res.exit_code == 2 and res.output.startswith("error: --ep 3: must divide dp*tp=2; valid: [1, 2]"), \
        res.output
    res = CliRunner().invoke(app, ["verify", "--pp", "1", "--zero", "1"])
    assert res.exit_code == 2 and "runs no optimizer step" in res.output, res.output


def test_every_field_is_documented_and_is_an_option_with_that_help():
    from plait.cli.options import option_help
    from plait.train.config import TRAIN_PARALLEL

    docs = {name: option_help(doc, getattr(TRAIN_PARALLEL, name)) for name, doc in field_docs().items()}
    assert set(docs) == set(field_names()) and all(len(d) > 20 for d in docs.values())
    shown = " ".join(CliRunner().invoke(app, ["train", "--help"], terminal_width=400).output.split())
    for name in field_names():
        assert f"--{name.replace('_', '-')}" in shown, name
        assert docs[name] in shown, name


def test_microbatches_help_says_what_the_number_counts():
    """--microbatches counts one pipeline's micro-batches per optimizer step: its help says so, how it splits the
    global batch over dp, and the default each command uses (train: 4, verify: 8), not the library's default for
    the field left None (pp), which the help said beside [default: 4] ('Left unset (None, from Python): pp')."""
    for command, default in (("train", 4), ("verify", 8)):
        shown = " ".join(CliRunner().invoke(app, [command, "--help"], terminal_width=400).output.split())
        text = shown[shown.index("--microbatches INT"):].split(" --virtual-stages")[0]
        for needle in ("each pipeline (one per data-parallel replica) runs per optimizer step",
                       "multiple of dp x M", "batch / (dp x M) sequences",
                       f"smaller. [default: {default}]"):
            assert needle in text, (command, needle, text)
        assert "None" not in text and "Python" not in text and "pp, one per" not in text, (command, text)
    from plait.cli.options import option_help

    doc = field_docs()["microbatches"]  # the library's default, and a command that would leave it None
    assert doc.endswith("Unset (None): pp, one per pipeline stage.")
    assert option_help(doc, None).endswith("smaller. Left out: pp, one per pipeline stage."), option_help(doc, None)


def test_init_takes_a_config_or_keywords_not_both():
    with pytest.raises(ConfigError, match="not both"):
        plait.init(tp=2, config=ParallelConfig(tp=2))


def test_plan_layout_converts_or_refuses_what_the_runtime_cannot_run():
    from plait.plan import Layout, Training

    lay = Layout(tp=2, pp=4, dp=2, virtual_stages=2, schedule="interleaved-1f1b", sequence_parallel=True, zero=1)
    cfg = lay.to_parallel_config(Training(global_batch=64))
    assert cfg == ParallelConfig(tp=2, pp=4, dp=2, schedule="interleaved-1f1b", microbatches=32, virtual_stages=2,
                                 sequence_parallel=True, zero=1, precision="bf16")
    assert Layout(recompute="selective").to_parallel_config().recompute == "selective"
    ring = Layout(cp=4, cp_comm="ring").to_parallel_config()
    assert (ring.cp, ring.cp_comm) == (4, "ring") and Layout.from_parallel_config(ring.resolve(4)).cp_comm == "ring"
    assert Layout(zero=3, dp=4).to_parallel_config().zero == 3
    assert Layout(zero=3, pp=2, dp=2).to_parallel_config().zero == 3  # under a pipeline with one chunk per rank
    il = Layout(zero=3, pp=2, dp=2, virtual_stages=2, schedule="interleaved-1f1b")  # or two
    assert il.to_parallel_config(Training(global_batch=8)).zero == 3
    with pytest.raises(ConfigError, match="zero: 3 with schedule 'zb-h1'.* 1f1b, gpipe, interleaved-1f1b, looped-bfs "
                                          r"only \(no split backward\)"):
        Layout(zero=3, pp=2, dp=2, schedule="zb-h1").to_parallel_config()


def test_train_config_holds_one_and_keeps_the_flat_keys():
    from plait.train.config import TRAIN_PARALLEL, TrainConfig

    cfg = TrainConfig.from_dict({"tp": 1, "pp": 4, "seq_len": 64, "schedule": "zbv"})
    assert cfg.parallel == ParallelConfig(tp=1, pp=4, dp=1, microbatches=4, schedule="zbv")
    assert cfg.to_dict()["tp"] == 1 and cfg.to_dict()["seq_len"] == 64
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert TrainConfig().parallel is TRAIN_PARALLEL
    with pytest.raises(ConfigError, match="schedule"):
        TrainConfig.from_dict({"schedule": "zigzag"})


def test_the_config_imports_no_torch():
    code = "import sys, plait; plait.ParallelConfig(tp=2); import plait.plan; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
