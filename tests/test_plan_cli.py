"""``plait plan`` / ``plait topo``: clear one-line errors, JSON output, topology from a file."""

import json
import re
import sys

import pytest
from typer.testing import CliRunner

from plait.cli.main import app
from plait.errors import ConfigError
from plait.hf_config import FAMILY_FIELDS

runner = CliRunner()


def test_unknown_gpu_lists_valid_names():
    r = runner.invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h1000"])
    assert r.exit_code == 2
    assert "error: --gpu 'h1000': unknown GPU" in r.output and "h100-sxm" in r.output
    assert "Traceback" not in r.output


def test_attention_kernel_is_an_option_and_checked_against_the_gpu():
    r = runner.invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "a100-80gb",
                            "--attention", "flash3"])
    assert r.exit_code == 2
    assert "'flash3' runs on Hopper GPUs only; valid on a100-80gb: flash1, triton-ops, flash2" in r.output
    fast, slow = (json.loads(runner.invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "8", "--json", "--top", "1",
                                                 "--global-batch", "64", "--attention", k]).output)
                  for k in ("cudnn", "flash1"))
    assert fast["best"][0]["step_time_s"] < slow["best"][0]["step_time_s"]


@pytest.mark.parametrize("args,needle", [
    (["--global-batch", "0"], "error: --global-batch 0: must be >= 1 sequence"),
    (["--top", "0"], "error: --top 0: how many layouts to keep, must be >= 1"),
    (["--top", "0", "--global-batch", "64"], "error: --top 0"),
    (["--seq-len", "0"], "error: --seq-len 0: must be a positive integer"),
    (["--gpus", "0"], "error: --gpus 0: must be >= 1"),  # Cluster's n_gpus, as the flag the user typed
    (["--gpus-per-node", "0"], "error: --gpus-per-node 0: must be >= 1"),
    (["--interconnect", "ib"], "error: --interconnect 'ib': unknown; valid: ib-hdr"),
    (["--max-memory-fraction", "2"], "error: --max-memory-fraction 2.0: must be in (0, 1]"),
    (["--precision", "fp8"], "error: --precision 'fp8': not one of fp32, bf16"),
    (["--inference", "--prompt-len", "0"], "error: --prompt-len 0: must be >= 1"),
    (["--inference", "--weights", "int3"], "error: --weights 'int3': not one of bf16"),
    (["--batch", "64"], "error: --batch 64: serving option, which only --inference reads (a training plan's batch "
                        "is --global-batch)"),  # not silently ignored
    (["--prompt-len", "512", "--weights", "fp8"], "error: --prompt-len 512, --weights fp8: serving options"),
    (["--cluster", "README.md", "--gpu", "a100-80gb", "--gpus-per-node", "4"], "error: --gpu a100-80gb, "
                                                                              "--gpus-per-node 4: not with --cluster"),
    (["--inference", "--global-batch", "64", "--show-schedule"], "error: --global-batch 64, --show-schedule: training "
                                                                "options, which --inference ignores"),
    (["--attention", "flash4"], "error: --attention 'flash4': unknown kernel; valid: sdpa, flash1, triton-ops, "
                                "flash2, cudnn, flash3, unfused"),
])
def test_bad_values_are_errors_naming_them_not_defaults(args, needle):
    r = runner.invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "4", *args])
    assert r.exit_code == 2 and r.output.startswith(needle), r.output


def test_write_config_header_says_what_its_mb_label_counts(tmp_path):
    """The layout label's mbN is sequences per micro-batch; the file's microbatches is how many per step."""
    from plait.train.config import read_toml

    out = tmp_path / "run.toml"
    r = runner.invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "512", "--write-config",
                            str(out)])
    assert r.exit_code == 0, r.output
    header = out.read_text().splitlines()[:2]
    values = read_toml(out)
    size = int(header[0].split(" mb")[1].split()[0])
    assert values["batch_size"] == values["dp"] * values["microbatches"] * size, (header, values)
    assert header[1] == (f"# mb{size}: micro-batches of {size} sequence{'s' * (size != 1)}: batch-size 512 = dp "
                         f"{values['dp']} x microbatches {values['microbatches']} x {size}"), header


def test_write_config_through_a_file_is_an_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "run.toml"
    r = runner.invoke(app, ["plan", "--model", "tiny", "--gpus", "4", "--gpu", "cpu", "--gpus-per-node", "4",
                            "--write-config", str(out)])
    assert r.exit_code == 2 and r.output.startswith(f"error: --write-config {out}: "), r.output


def test_unknown_model_lists_presets():
    r = runner.invoke(app, ["plan", "--model", "gpt5", "--gpus", "8"])
    assert r.exit_code == 2 and r.output.startswith("error: --model 'gpt5': unknown preset; valid: ") \
        and "llama3-70b" in r.output and "Traceback" not in r.output
    from plait.plan import Cluster, Model  # the library names its own parameters

    with pytest.raises(ConfigError, match=r"^n_gpus=0: must be >= 1$"):
        Cluster("h100-sxm", 0)
    with pytest.raises(ConfigError, match=r"^seq_len=0: must be a positive integer$"):
        Model.preset("tiny", seq_len=0)


def test_model_that_fits_nowhere_says_what_would():
    r = runner.invoke(app, ["plan", "--model", "llama3-405b", "--gpus", "8", "--gpu", "a100-80gb"])
    assert r.exit_code == 1
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: llama3-405b on 8 × a100-80gb: no layout fits")
    assert "such GPUs" in lines[0]


def test_plan_json_and_table():
    r = runner.invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--json",
                            "--top", "3", "--seq-len", "4096", "--global-batch", "64"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert len(out["best"]) == 3 and out["best"][0]["fits"] and out["why"][0].startswith("best: ")
    r = runner.invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "8", "--show-schedule",
                            "--global-batch", "64", "--seq-len", "4096"])
    assert r.exit_code == 0 and "MFU" in r.output and "best:" in r.output


def test_plan_inference_cli():
    r = runner.invoke(app, ["plan", "--model", "llama3-70b", "--gpus", "4", "--gpu", "a100-80gb", "--inference",
                            "--batch", "8"])
    assert r.exit_code == 0, r.output
    assert "best: tp4 pp1" in r.output
    # each figure of the per-token time has its unit ('memory 4.7,' read as 4.7 GB beside the memory table)
    assert re.search(r"ms/token, of which memory reads \d+\.\d ms and p2p \d+\.\d ms\)", " ".join(r.output.split())), \
        r.output


TOPO = """\
        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity
GPU0     X      NV4     NV4     NV4     0-15            0
GPU1    NV4      X      NV4     NV4     0-15            0
GPU2    NV4     NV4      X      NV4     0-15            0
GPU3    NV4     NV4     NV4      X      0-15            0
"""


def test_topo_from_file(tmp_path):
    f = tmp_path / "topo.txt"
    f.write_text(TOPO)
    r = runner.invoke(app, ["topo", "--file", str(f)])
    assert r.exit_code == 0 and "tp=4" in r.output and r.output.startswith(f"4 GPUs, read from --file {f}\n")
    f.write_text("nothing here")
    r = runner.invoke(app, ["topo", "--file", str(f)])
    assert r.exit_code == 2 and r.output.startswith(f"error: --file {f}: no 'GPU0 GPU1 ...' header"), r.output
    f.write_bytes(b"\xff\xfe\x00binary")  # was a UnicodeDecodeError traceback
    r = runner.invoke(app, ["topo", "--file", str(f)])
    assert r.exit_code == 2 and r.output.startswith(f"error: --file {f}: not text"), r.output


def test_topo_missing_file_is_an_error_naming_the_flag(tmp_path):
    r = runner.invoke(app, ["topo", "--file", str(tmp_path / "nope.txt")])
    assert r.exit_code == 2, r.output
    assert f"error: --file {tmp_path / 'nope.txt'}: no such file" in r.output and "Traceback" not in r.output


def test_topo_without_a_topology_to_read_says_why_and_exits_1(tmp_path, monkeypatch):
    """No nvidia-smi, or one that fails: an error naming which, exit code 1 (was a note and exit code 0)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    r = runner.invoke(app, ["topo"])
    assert r.exit_code == 1 and r.stderr == ("error: nvidia-smi is not on PATH (no NVIDIA driver here): no GPU "
                                             "topology read. Pass --file with a saved `nvidia-smi topo -m` output.\n")
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 9\n")
    smi.chmod(0o755)
    r = runner.invoke(app, ["topo"])
    assert r.exit_code == 1 and r.stderr.startswith(f"error: `{smi} topo -m` failed (no driver loaded, or no"), r.output
    (tmp_path / "topo.txt").write_text(TOPO)
    smi.write_text(f"#!{sys.executable}\nprint(open({str(tmp_path / 'topo.txt')!r}).read())\n")
    r = runner.invoke(app, ["topo"])
    assert r.exit_code == 0 and r.stdout.startswith("4 GPUs, read from `nvidia-smi topo -m`\n"), r.output


def test_plan_topo_and_simulate_options_are_their_dataclasses_fields():
    """One option per field of PlanOptions / TopoOptions / SimulateOptions, its help the field's docstring, the
    default the field's (a field without one is required)."""
    import dataclasses

    import typer

    from plait.cli.plan import PlanOptions
    from plait.cli.simulate import SimulateOptions
    from plait.cli.topo import TopoOptions
    from plait.parallel_config import field_docs

    group = typer.main.get_command(app)
    for name, cls in (("plan", PlanOptions), ("topo", TopoOptions), ("simulate", SimulateOptions)):
        params = {p.name: p for p in group.commands[name].params}
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            p = params[f.name]
            assert p.help == docs[f.name], (name, f.name)
            if f.default is dataclasses.MISSING:
                assert p.required, (name, f.name)
            else:
                assert p.default == f.default and not p.required, (name, f.name)
        assert set(params) - {f.name for f in dataclasses.fields(cls)} <= {"virtual_alias"}, name
    assert {"--schedule", "-s"} <= set(next(p for p in group.commands["simulate"].params if p.name == "schedule").opts)


LLAMA = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096}


@pytest.mark.parametrize("bad, needle", [
    ({"num_hidden_layers": 0}, "num_hidden_layers = 0: must be a positive integer"),  # not --layers 0
    ({"num_attention_heads": 0}, "num_attention_heads = 0: must be a positive integer"),
    ({"num_key_value_heads": 0}, "num_key_value_heads = 0: must be a positive integer"),
    ({"num_key_value_heads": 5}, "num_key_value_heads = 5: must divide num_attention_heads = 32"),
    ({"num_attention_heads": 48}, "num_attention_heads = 48: must divide hidden_size = 4096"),
    ({"max_position_embeddings": 0}, "max_position_embeddings = 0: must be a positive integer"),
    ({"model_type": "mixtral", "num_local_experts": 2, "num_experts_per_tok": 4},
     "num_experts_per_tok = 4: must be at most num_local_experts = 2"),
    ({"num_hidden_layers": "32"}, "num_hidden_layers = '32': must be an integer"),
    ({"vocab_size": None}, "no vocab_size (the model's vocab); plait reads the configs of model_type "
     f"{', '.join(sorted(FAMILY_FIELDS))} and GPT-2/NeoX style ones"),
])
def test_a_bad_config_json_field_is_named_as_the_file_and_its_key_not_a_flag(tmp_path, bad, needle):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, **bad}))
    for model in (path, tmp_path):  # the file, or its Hugging Face folder
        r = runner.invoke(app, ["plan", "--model", str(model), "--gpus", "8"])
        assert r.exit_code == 2 and r.output.startswith(f"error: {path}: {needle}"), r.output
    r = runner.invoke(app, ["plan", "--model", str(path), "--gpus", "8", "--seq-len", "0"])
    assert r.output.startswith("error: --seq-len 0: must be a positive integer"), r.output  # a typed flag stays one


@pytest.mark.parametrize("args", [["--model", "llama3-8b", "--gpus", "16", "--gpu", "h100-sxm"],
                                  ["--model", "llama3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--inference"]])
def test_plan_tables_fit_80_columns_with_every_figure_whole(args):
    """In an 80-column terminal (COLUMNS=80) every line fits and no figure is cut to "…": the training table's
    layout and memory sum wrap at their spaces, the serving layouts come as a memory table and a time table.
    The line of plait train flags is the one left whole, for the terminal to wrap: a line break in it would
    break the command it is copied as."""
    wide = json.loads(runner.invoke(app, ["plan", *args, "--json"]).output)
    r = runner.invoke(app, ["plan", *args], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    flags = [line for line in r.output.splitlines() if line.startswith("• as plait train flags: ")]
    assert len(flags) == ("--inference" not in args) and all(" --seq-len 8192 " in line for line in flags)
    lines = [line for line in r.output.splitlines() if line not in flags]
    assert max(len(line) for line in lines) <= 80 and "…" not in r.output, r.output
    if "--inference" in args:
        rows = [line for line in r.output.splitlines() if line.startswith("│ tp")]
        n = len(wide["options"])
        assert len(rows) == 2 * n, r.output  # each layout a row in each table, in the same order, figures whole
        for o, memory, time in zip(wide["options"], rows[:n], rows[n:], strict=True):
            cells = [c.strip() for c in memory.split("│")] + [c.strip() for c in time.split("│")]
            assert {str(o["max_batch"]), f"{o['max_context']:,}", f"{o['request_ms'] / 1e3:.2f}",
                    f"{o['throughput_tok_s']:,.0f}"} <= set(cells), (o, memory, time)
    else:
        for e in wide["best"]:
            assert f"{e['mfu']:.1%}" in r.output and f"{e['bubble_fraction']:.1%}" in r.output, e


def test_plan_inference_says_its_kv_column_is_the_cache_s_room_not_the_model_s_context():
    """The memory table's 'max ctx' (150,991,349 for tiny, whose context is 512) read as the model's context: the
    column is the KV cache's room per sequence, says so under the table beside the model's own context, and a
    workload longer than that context gets a note."""
    r = runner.invoke(app, ["plan", "--model", "tiny", "--gpus", "2", "--inference"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "max ctx" not in text and "KV tok/seq" in text, r.output
    assert ("KV tok/seq: tokens of KV cache there for each sequence of a batch of 1: the cache's room, not the "
            "model's context; tiny's own context is 512 tokens.") in text, r.output
    assert ("note: a sequence here is 1,280 tokens (--prompt-len 1024 + --gen-len 256), longer than tiny's context "
            "of 512 tokens") in text, r.output
    r = runner.invoke(app, ["plan", "--model", "tiny", "--gpus", "2", "--inference", "--prompt-len", "256"])
    assert r.exit_code == 0 and "longer than tiny's context" not in r.output, r.output
    r = runner.invoke(app, ["plan", "--model", "llama3-70b", "--gpus", "4", "--gpu", "a100-80gb", "--inference"])
    assert "the cache's room, not the model's context." in " ".join(r.output.split()), r.output  # context not known


def test_a_hf_config_s_context_is_its_max_position_embeddings_uncapped(tmp_path):
    from plait.plan import Model

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 256, "intermediate_size": 128, "max_position_embeddings": 131072}))
    model = Model.from_hf_config(tmp_path)
    assert model.context == 131072 and model.seq_len == 8192  # the planned training length stays capped


def test_the_reasons_name_an_overhead_only_where_there_is_one_and_count_in_one_unit(tmp_path):
    """'its largest overhead is optimizer step: 0.00 s (0% of the step)' was said of a step that is all compute;
    the rejected layouts were counted without separators ('rejected 10476 of 18,354 layouts (memory: 6759, ...)');
    a small run's memory was MB (10^6 bytes) in the table, GB in the best line ('0.1 of 5.7 GB') and MiB in plait
    train's prediction. Now: no overhead named under 1% of the step, every count with separators, and small runs
    in MiB, as plait train says a rank's memory."""
    from collections import Counter
    from dataclasses import replace

    from plait.plan import Cluster, Model, Training, explain, search
    from plait.plan.search import SearchResult
    from profile_util import synthetic_profile

    best = search(Model.preset("llama3-8b"), Cluster("h100-sxm", 16), Training(64), top=1).best[0]
    step = best.step_time_s
    alone = replace(best, time={k: (0.995 * step if k == "compute" else 0.005 * step if k == "optimizer" else 0.0)
                                for k in best.time})
    lines = explain(SearchResult([alone], Counter({"memory": 6759, "tp>node": 2448}), pruned=7872, considered=18354))
    assert lines[1].startswith("no overhead reaches 1% of the step: compute is 100% of it; bubble"), lines
    assert lines[2] == ("rejected 9,207 of 18,354 layouts (memory: 6,759, tp>node: 2,448); 7,872 valid ones pruned "
                        "as slower"), lines
    some = replace(alone, time={**alone.time, "optimizer": 0.02 * step, "compute": 0.98 * step})
    assert explain(SearchResult([some]))[1].startswith("its largest overhead is optimizer step: "), explain
    synthetic_profile().save(tmp_path / "host.toml")
    args = ["plan", "--model", "tiny", "--gpus", "2", "--cluster", str(tmp_path / "host.toml"), "--global-batch", "8"]
    text, as_json = (runner.invoke(app, args + extra) for extra in ([], ["--json"]))
    memory = json.loads(as_json.output)["best"][0]["memory"]
    assert "memory MiB: weights + grads + optim + activ + transient" in text.output, text.output
    assert f"{memory['total'] / 2**20:,.1f} of {memory['usable'] / 2**20:,.1f} MiB" in text.output, text.output


def test_a_long_sequence_planned_without_context_parallelism_says_so():
    """Context parallelism is searched from CP_MIN_SEQ_LEN tokens; a plan of a long sequence below that (16k) said
    nothing of it, as if it had been weighed. It now says it was not searched; 8k plans and CP-searched ones do not."""
    from plait.plan import Cluster, Model, Training, explain, search
    from plait.plan.search import CP_MIN_SEQ_LEN

    said = {}
    for seq in (8192, 16384, CP_MIN_SEQ_LEN):
        result = search(Model.preset("llama3-8b", seq), Cluster("h100-sxm", 8), Training(8), top=1)
        said[seq] = [line for line in explain(result) if "context parallelism" in line]
    assert said[16384] == ["context parallelism was not searched: the search splits sequences of 32,768 tokens or "
                           "more, these are 16,384 (plait.plan.estimate costs a layout with cp > 1)"], said
    assert said[8192] == said[CP_MIN_SEQ_LEN] == [], said


def test_the_docs_legend_of_a_layout_label_is_a_real_label_and_names_each_part():
    """docs/planner.md explains a layout label by an example: that example is what Layout.short() writes, and each of
    its parts is explained there (cp's 'r', ring, and 'etp' were not)."""
    from pathlib import Path

    from plait.plan import Layout

    docs = " ".join((Path(__file__).parents[1] / "docs" / "planner.md").read_text().split())
    legend = docs[docs.index("A layout label reads"):][:1200]
    label = Layout(tp=2, pp=4, dp=8, cp=2, cp_comm="ring", ep=4, expert_tp=True, virtual_stages=2,
                   sequence_parallel=True, recompute="selective", zero=1, schedule="interleaved-1f1b").short()
    assert f"e.g. `{label}`" in legend, legend
    for part in label.split()[3:-1]:
        assert f"`{part}`" in legend, part
    assert all(f"`{w}`" in legend for w in ("cp2", "full", "norc", "cut uniform", "padded-rounds", "(plan-only)"))
