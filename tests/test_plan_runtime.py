"""What the planner recommends, the runtime runs: the search space is the runtime's (one table), plan-only
layouts are marked and never converted, memory headroom, ``plait plan --write-config`` and ``plait train
--layout auto`` (the runs themselves: tests/test_pipeline.py, every emitted value through plait.parallelize)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import checks_plan
from plait.cli.main import app
from plait.errors import ConfigError
from plait.models import Llama, LlamaConfig
from plait.parallel_config import RECOMPUTE_MODES, ZERO3_SCHEDULES, ZERO_LEVELS, ParallelConfig
from plait.plan import Cluster, Layout, Model, Training, search
from plait.plan.config import RUNTIME, check
from plait.plan.search import candidates
from plait.schedules import SCHEDULE_NAMES

CASES = [("llama3-70b", 32, None), ("mixtral-8x7b", 16, None), ("llama3-8b", 16, 32768)]


def _valid(model: Model, cluster: Cluster, training: Training, plan_only: bool = False) -> list[Layout]:
    return [lay for lay in candidates(model, cluster, training, plan_only)
            if check(model, cluster, lay, training) is None]


@pytest.mark.parametrize("name,gpus,seq", CASES)
def test_search_emits_only_what_the_runtime_runs(name, gpus, seq):
    model, cluster, training = Model.preset(name, seq), Cluster("h100-sxm", gpus), Training(64, masters="plait")
    layouts = _valid(model, cluster, training)
    got = checks_plan.values(layouts)
    assert (got["cp"] == {1}) == (model.seq_len < 32768)  # context parallelism runs; searched for long sequences
    if model.seq_len >= 32768:
        assert got["cp_comm"] == {"allgather", "ring"}
    assert got["recompute"] == set(RECOMPUTE_MODES) and got["zero"] <= set(ZERO_LEVELS)
    assert got["schedule"] <= set(SCHEDULE_NAMES) and RUNTIME["schedule"] == SCHEDULE_NAMES
    assert all(lay.runnable for lay in layouts)
    for lay in checks_plan.covering(layouts):  # each value converted at least once (a conversion builds a schedule)
        assert isinstance(lay.to_parallel_config(training), ParallelConfig)
    for est in search(model, cluster, training, top=3):
        assert est.layout.runnable and est.to_dict()["runnable"] is True


def test_runtime_table_is_the_runtime_s_own():
    """The search's recompute and ZeRO values are exactly those ParallelConfig accepts (a value added there
    appears in the search); ZeRO-3 with and without a pipeline, under the schedules without a split backward only
    (interleaved-1f1b among them), as the runtime runs it."""
    model, cluster, training = Model.preset("llama3-8b"), Cluster("h100-sxm", 16), Training(64, masters="plait")
    layouts = _valid(model, cluster, training)
    got = checks_plan.values(layouts)
    assert got["zero"] == set(RUNTIME["zero"]) == set(ZERO_LEVELS)  # 0 without DP, the sharded stages with it
    assert {lay.pp for lay in layouts if lay.zero == 3} > {1}  # the search picks ZeRO-3 with a pipeline too
    assert "interleaved-1f1b" in {lay.schedule for lay in layouts if lay.zero == 3} <= set(ZERO3_SCHEDULES)
    assert all(lay.to_parallel_config(training).zero == 3 for lay in layouts if lay.zero == 3)


def test_plan_only_layouts_are_marked_and_never_converted():
    model, cluster, training = Model.preset("llama3-8b", 32768), Cluster("h100-sxm", 16), Training(64)
    layouts = _valid(model, cluster, training, plan_only=True)
    plan_only = [lay for lay in layouts if not lay.runnable]
    assert {lay.zero for lay in plan_only} == {3}  # context parallelism runs; ZeRO-3 is modelled plan-only
    assert {lay.schedule for lay in plan_only}.isdisjoint(ZERO3_SCHEDULES)  # under a split backward
    for lay in plan_only[:20]:
        assert "(plan-only)" in lay.short()
        with pytest.raises(ConfigError, match="zero"):
            lay.to_parallel_config(training)
    res = CliRunner().invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "16", "--seq-len", "32768",
                                   "--global-batch", "64", "--plan-only", "--top", "40", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["best"]
    assert any(not r["runnable"] and r["plan_only_reason"] for r in rows)
    assert all(r["runnable"] == (r["layout"]["zero"] < 3 or r["layout"]["schedule"] in ZERO3_SCHEDULES)
               for r in rows)


def test_memory_headroom_is_ninety_percent_unless_asked():
    model, training = Model.preset("llama3-70b"), Training(128)
    default = Cluster("h100-sxm", 32)
    assert default.usable_memory == pytest.approx(0.9 * default.gpu.memory)
    for fraction in (0.9, 0.6):
        cluster = Cluster("h100-sxm", 32, max_memory_fraction=fraction)
        best = search(model, cluster, training, top=5)
        assert best.best and all(e.memory.total <= fraction * cluster.gpu.memory for e in best)
    tight = search(model, Cluster("h100-sxm", 32, max_memory_fraction=0.6), training, top=5)
    assert max(e.memory.total for e in tight) < max(e.memory.total for e in search(model, default, training, top=5))
    with pytest.raises(ConfigError, match="max_memory_fraction"):
        Cluster("h100-sxm", 8, max_memory_fraction=1.5)


@pytest.fixture
def launched(monkeypatch):
    """``plait train`` parses and validates as usual, then hands its payload here instead of launching."""
    import plait.distributed.launch as launch_module

    got: dict = {}
    monkeypatch.setattr(launch_module, "launch",
                        lambda target, payload, n, *signals, **how: got.update(payload=payload, n=n))
    return got


def test_write_config_loads_in_plait_train_as_that_layout(tmp_path, launched):
    folder = tmp_path / "model"
    Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64)).save_pretrained(
        folder)
    run = tmp_path / "run.toml"
    args = ["plan", "--model", str(folder), "--gpus", "4", "--gpu", "cpu", "--gpus-per-node", "4", "--seq-len", "32",
            "--global-batch", "8", "--write-config", str(run), "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    best = json.loads(res.output)["best"][0]
    planned = Layout(**best["layout"]).to_parallel_config(Training(8, masters="plait"))
    res = CliRunner().invoke(app, ["train", "--config", str(run), "--max-data-mb", "0.1"])
    assert res.exit_code == 0, res.output
    from plait.train import TrainConfig

    cfg = TrainConfig.from_dict(launched["payload"])
    assert cfg.parallel == planned and launched["n"] == 4
    assert (cfg.model, cfg.batch_size, cfg.seq_len) == (str(folder), 8, 32)


@pytest.mark.parametrize("where", ["folder on cpu gpus", "preset on a host profile"])
def test_the_flags_plait_plan_prints_run_in_plait_train_as_they_are(tmp_path, launched, where):
    """``plait plan`` ends with the best layout as ``plait train`` flags (the JSON's ``train_flags``); pasted as
    they are, plait train runs that layout, batch and sequence length on the plan's process count (with
    ``--cluster``: the same profile, so the run's prediction is the plan's)."""
    import shlex
    from dataclasses import replace

    from profile_util import synthetic_profile

    if where == "folder on cpu gpus":
        model = str(tmp_path / "model")
        Llama(LlamaConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64)
              ).save_pretrained(model)
        hardware = ["--gpu", "cpu", "--gpus-per-node", "4", "--precision", "bf16"]
    else:
        model = "tiny"
        synthetic_profile().save(tmp_path / "host.toml")
        hardware = ["--cluster", str(tmp_path / "host.toml")]
    args = ["plan", "--model", model, "--gpus", "4", "--seq-len", "32", "--global-batch", "8", *hardware]
    text, as_json = (CliRunner().invoke(app, args + extra) for extra in ([], ["--json"]))
    assert text.exit_code == 0 and as_json.exit_code == 0, text.output + as_json.output
    line = next(x for x in text.output.splitlines() if x.startswith("• as plait train flags: "))
    words = shlex.split(line.removeprefix("• as plait train flags: "))
    out = json.loads(as_json.output)
    assert words == out["train_flags"] and words[:2] == ["--model", model], line
    best = out["best"][0]
    precision = "bf16" if "--precision" in words else "fp32"
    planned = Layout(**best["layout"]).to_parallel_config(Training(8, precision=precision, masters="plait"),
                                                          rounds=best["rounds"])
    res = CliRunner().invoke(app, ["train", *words, "--max-data-mb", "0.1"])
    assert res.exit_code == 0, res.output
    from plait.train import TrainConfig

    cfg = TrainConfig.from_dict(launched["payload"])
    ran = cfg.parallel
    assert replace(ran, virtual_stages=ran.pipeline_schedule().virtual) == planned and launched["n"] == 4
    assert (cfg.model, cfg.batch_size, cfg.seq_len) == (model, 8, 32)
    assert cfg.cluster == (None if model != "tiny" else str(tmp_path / "host.toml"))


def test_a_plan_plait_train_would_refuse_says_why_instead_of_flags(tmp_path):
    """A plan of sequences longer than the model's context (plait train refuses a --seq-len beyond it), or of a
    config whose family plait train does not build (Qwen2-MoE), printed flags that plait train then refused; it
    now says why plait train does not run it, gives no train_flags and writes no --config file."""
    other = tmp_path / "qwen2moe"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({
        "model_type": "qwen2_moe", "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64,
        "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 4096}))
    cpu = ["--gpus", "4", "--gpu", "cpu", "--gpus-per-node", "4", "--global-batch", "8"]
    for model, seq, why in (("tiny", "1024", "--seq-len 1024 exceeds tiny's context of 512 tokens (the preset's "
                                             "max_seq_len), which plait train keeps to"),
                            (str(other), "512", f"--model {other}: model_type 'qwen2_moe' is not one plait train "
                                                "builds (llama, mistral, mixtral, qwen2, qwen3, qwen3_moe)")):
        args = ["plan", "--model", model, "--seq-len", seq, *cpu]
        text, as_json = (CliRunner().invoke(app, args + extra) for extra in ([], ["--json"]))
        assert text.exit_code == 0 and f"\n• plait train does not run it: {why}\n" in text.output, text.output
        assert json.loads(as_json.output)["train_flags"] is None
        written = CliRunner().invoke(app, args + ["--write-config", str(tmp_path / "run.toml")])
        assert written.exit_code == 2 and written.output == f"error: --write-config: {why}\n", written.output
        assert not (tmp_path / "run.toml").exists()
    refused = CliRunner().invoke(app, ["train", "--model", "tiny", "--seq-len", "1024", "--cluster", "none",
                                       "--dry-run"])
    assert refused.exit_code == 2 and "--seq-len 1024 exceeds the model's max_seq_len 512" in refused.output


def test_the_flags_leave_out_what_plait_train_does_when_they_are_left_out():
    """The flags of an interleaved plan said '--virtual-stages 4 --rounds equal' and those of any 1F1B plan
    '--virtual-stages 1': equal rounds and a schedule's own chunk count are what plait train runs without the flag,
    so only a count other than the schedule's is written; the schedule plait train then builds is the planned one."""
    import typer

    from plait.cli.plan_config import plan_flags
    from plait.parallel_config import field_names
    from plait.plan import estimate

    model, cluster, training = Model.preset("llama3-70b"), Cluster("h100-sxm", 64), Training(64, masters="plait")
    for layout, virtual in ((Layout(tp=8, pp=8, virtual_stages=4, schedule="interleaved-1f1b", recompute="full"),
                             ["--virtual-stages", "4"]),
                            (Layout(tp=8, pp=8, virtual_stages=2, schedule="zbv", recompute="full"), []),
                            (Layout(tp=8, pp=8, recompute="full"), [])):
        est = estimate(model, cluster, layout, training)
        words = plan_flags(est, "tiny", None) or []
        assert "--rounds" not in words and [w for w in words if w == "--virtual-stages"] == virtual[:1], words
        assert words[words.index("--virtual-stages") + 1] == "4" if virtual else True
        train = typer.main.get_command(app).get_command(None, "train")
        read = train.make_context("train", list(words)).params  # as plait train reads its flags
        planned = layout.to_parallel_config(training, rounds=est.rounds).pipeline_schedule()
        ran = ParallelConfig(**{k: read[k] for k in field_names()}).pipeline_schedule()
        assert (ran.actions, ran.virtual) == (planned.actions, planned.virtual), layout.short()


def test_plan_on_gpus_predicts_the_step_plait_train_dry_run_predicts(tmp_path):
    """On catalogue GPUs ``plait plan`` costs plait's own eager element-wise kernels and the attention kernel
    plait's SDPA runs there (cuDNN's on an H100), as ``plait train --dry-run`` does for the layout it writes (the
    same step); ``--elementwise fused`` costs the fitted fused term instead."""
    from plait.cli.predict import planner_inputs
    from plait.plan.runs import predict_train
    from plait.train import TrainConfig
    from plait.train.config import read_toml

    folder = tmp_path / "model"
    Llama(LlamaConfig(vocab_size=32000, dim=1024, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=2048)
          ).save_pretrained(folder)
    steps = {}
    for flag in ("plait-eager", "fused"):
        run = tmp_path / f"{flag}.toml"
        res = CliRunner().invoke(app, ["plan", "--model", str(folder), "--gpus", "8", "--gpu", "h100-sxm", "--seq-len",
                                       "2048", "--global-batch", "32", "--top", "1", "--write-config", str(run),
                                       "--json"] + (["--elementwise", flag] if flag == "fused" else []))
        assert res.exit_code == 0, res.output
        out = json.loads(res.output)
        assert out["elementwise"] == flag
        steps[flag] = out["best"][0]["step_time_s"]
    cfg = TrainConfig.from_dict(read_toml(tmp_path / "plait-eager.toml"))
    model, layout, training = planner_inputs(cfg, 8)
    dry_run = predict_train(model, Cluster("h100-sxm", 8, flash_attention="sdpa"), layout, training).step_time_s
    assert dry_run == pytest.approx(steps["plait-eager"], rel=1e-9)
    assert steps["fused"] < 0.97 * steps["plait-eager"]  # plait's unfused kernels move more bytes
    bad = CliRunner().invoke(app, ["plan", "--model", "llama3-8b", "--gpus", "8", "--elementwise", "triton"])
    assert bad.exit_code != 0 and "fused, plait-eager" in bad.output


def test_layout_auto_takes_the_planner_s_fastest_that_runs(launched, tmp_path, monkeypatch):
    from plait.cli.auto_layout import auto_layout, host_cluster, plan_model
    from plait.train import TrainConfig

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "empty-cache"))  # an uncalibrated host: the catalogue's cpu

    res = CliRunner().invoke(app, ["train", "--layout", "auto", "--nproc", "4", "--seq-len", "32", "--batch-size",
                                   "8", "--max-data-mb", "0.1"])
    assert res.exit_code == 0, res.output
    cfg = TrainConfig.from_dict(launched["payload"])
    want = TrainConfig.from_dict({"seq_len": 32, "batch_size": 8, "max_data_mb": 0.1, "nproc": 4})
    training = Training(8, precision="fp32", elementwise="plait-eager")  # plait train's precision and kernels
    best = search(plan_model(want), host_cluster(4), training, top=20)[0].layout  # as auto_layout asks
    assert cfg.parallel == best.to_parallel_config(training, precision="fp32")
    assert f"--layout auto: {best.short()}" in res.output and "generic cpu" in res.output
    assert cfg.layout == "flags" and launched["n"] == 4
    assert auto_layout(want, 4)[0].parallel == cfg.parallel
    bad = CliRunner().invoke(app, ["train", "--layout", "guess"])
    assert bad.exit_code == 2 and "--layout 'guess'" in bad.output


def test_layout_auto_plans_on_the_calibrated_host(tmp_path, monkeypatch):
    """With a profile (--cluster FILE, or this host's cached calibration) --layout auto plans on its measured
    speeds, not the catalogue's generic cpu."""
    from plait.calibrate import cache_path
    from plait.cli.auto_layout import auto_layout, plan_model
    from plait.plan.eager import RUNTIME_ELEMENTWISE
    from plait.plan.optimizers import RUNTIME_MASTERS
    from plait.train import TrainConfig
    from profile_util import synthetic_profile

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    want = TrainConfig.from_dict({"seq_len": 32, "batch_size": 8, "max_data_mb": 0.1, "nproc": 4})
    profile = synthetic_profile()
    training = Training(8, precision="fp32", elementwise=RUNTIME_ELEMENTWISE, masters=RUNTIME_MASTERS)  # plait's own
    best = search(plan_model(want), Cluster.from_profile(profile, 4), training, top=20)[0]
    profile.save(tmp_path / "host.toml")
    chosen = TrainConfig.from_dict({**want.to_dict(), "cluster": str(tmp_path / "host.toml")})
    cfg, line = auto_layout(chosen, 4)
    assert cfg.parallel == best.layout.to_parallel_config(training, precision="fp32")
    assert f"on the profile {tmp_path / 'host.toml'}: {best.step_time_s:.3g} s/step" in line
    mib = f"{best.memory.total / 2**20:,.1f} of {best.memory.usable / 2**20:,.1f} MiB per process predicted"
    assert mib in line, line  # as plait plan and the run's memory table say it (was '0.07 of 5.69 GB')
    profile.save(cache_path())  # the cached calibration of this host is used when no --cluster is given
    assert "on this host's calibration" in auto_layout(want, 4)[1]


def test_a_bf16_plan_with_masters_kept_apart_converts_only_where_plait_holds_the_same_bytes():
    """A plan made with Megatron-LM's masters (``masters="apart"``, the library's default: bf16 weights beside
    float32 masters and moments) holds, in bf16 without ZeRO, bytes plait's runtime does not (its float32
    parameters are their own masters): to_parallel_config refuses it, naming masters and the value to plan
    with. Where both ways hold the same bytes (fp32; ZeRO-1, 2, 3) it converts."""
    from plait.plan.memory import state_bytes
    from plait.plan.optimizers import masters_gap

    model = Model.preset("llama3-8b")
    for precision in ("bf16", "fp32"):
        for zero in ZERO_LEVELS:
            layout, training = Layout(dp=2, zero=zero), Training(8, precision=precision)
            held = {m: state_bytes(model, layout, model.n_layers, True, True, precision, "fp32", m)
                    for m in ("apart", "plait")}
            same = held["apart"] == held["plait"]
            assert same == (precision == "fp32" or zero > 0), (precision, zero, held)
            assert (masters_gap("apart", precision, zero) is None) == same
            if same:
                assert layout.to_parallel_config(training, precision=precision).zero == zero
                continue
            with pytest.raises(ConfigError, match=r"^masters: 'apart' is planned \(bf16 weights beside float32 masters"
                                                  r" .*: plan with masters='plait'$"):
                layout.to_parallel_config(training, precision=precision)
            assert layout.to_parallel_config(Training(8, masters="plait")).zero == zero


def test_the_configuration_runs_the_plan_s_precision():
    """The precision a plan was costed at (``Training.precision``) is the one its configuration runs: taken from
    the training when none is asked for, refused with a ConfigError naming both when another is."""
    layout = Layout(dp=2, zero=1)
    assert layout.to_parallel_config(Training(8, precision="fp32")).precision == "fp32"
    assert layout.to_parallel_config(Training(8)).precision == "bf16"
    assert layout.to_parallel_config(Training(8, precision="fp32"), precision="fp32").precision == "fp32"
    assert layout.to_parallel_config().precision == "bf16" and layout.to_parallel_config(precision="fp32").precision \
        == "fp32"
    with pytest.raises(ConfigError, match=r"^precision: 'bf16' is asked for but 'fp32' is planned \(Training\."
                                          r"precision\): leave precision unset .* or plan with 'bf16'$"):
        layout.to_parallel_config(Training(8, precision="fp32"), precision="bf16")
