"""What plait train says of what it does not do as asked: a resumed run whose settings of the sample stream or the
optimizer differ from the checkpoint's run, a sample that a layout splitting the sequence cannot draw."""

from __future__ import annotations

import json
import subprocess
import sys

from plait.train.config import TrainConfig
from plait.train.resume import changed_effects, changed_settings, resume_note

RUN = [sys.executable, "-m", "plait.cli.main", "train", "--tp", "1", "--pp", "1", "--microbatches", "1",
       "--eval-every", "0", "--sample-tokens", "0", "--cluster", "none", "--data", "text", "--batch-size", "2"]
#: RUN's settings, for a run of one process made in this process (run_here)
ONE = dict(tp=1, pp=1, dp=1, microbatches=1, eval_every=0, sample_tokens=0, data=["text"], batch_size=2)


def run_here(folder, monkeypatch, **settings) -> str:
    """``plait train`` of one process with RUN's flags and ``settings``, run in this process from ``folder`` (no
    launcher, no worker to start: the same loop and reporter its worker runs); what it printed."""
    import io

    from rich.console import Console

    import plait.train.loop as loop
    from plait.train.report import Reporter

    monkeypatch.chdir(folder)
    cfg = TrainConfig.from_dict({**ONE, **settings})
    log = io.StringIO()
    loop.train(cfg, reporter=Reporter(cfg, 0, Console(file=log, width=200)))
    return log.getvalue()


def test_changed_settings_name_the_flags_with_both_values():
    saved = TrainConfig(seq_len=32, data=["a"]).to_dict()
    resharded = TrainConfig.from_dict({**saved, "tp": 1, "pp": 4, "resume": True})  # another layout reshards
    assert changed_settings(saved, resharded) == []
    assert changed_settings(saved, TrainConfig(seq_len=64, data=["a", "b"], seed=3, lr=1e-2)) == [
        "--data a -> a b", "--seq-len 32 -> 64", "--seed 0 -> 3", "--lr 0.003 -> 0.01"]
    assert changed_settings({**saved, "data": []}, TrainConfig(seq_len=32, data=["a"])) == [
        "--data (the standard library) -> a"]
    bf16 = TrainConfig.from_dict({**saved, "precision": "bf16"})  # other arithmetic: was resumed without a word
    assert changed_settings(saved, bf16) == ["--precision fp32 -> bf16"]
    assert changed_effects(saved, bf16, 3) == ["updates"]
    masked = TrainConfig.from_dict({**saved, "document_mask": True})  # other attention and loss from here on
    assert changed_settings(saved, masked) == ["--document-mask False -> True"]
    assert changed_effects(saved, masked, 3) == ["updates"]


def test_a_resume_under_another_layout_names_the_layout_it_was_saved_under():
    """A checkpoint loaded under another layout said only 'resuming from ...', as if nothing were resharded."""
    from plait.parallel_config import ParallelConfig
    from plait.train.resume import resharded_from

    meta = {"layout": {"tp": 1, "pp": 1, "dp": 2, "cp": 1}, "train": {**TrainConfig().to_dict(), "dp": -1, "zero": 1}}
    assert resharded_from(meta, ParallelConfig(tp=1, pp=1, dp=2, zero=1)) is None
    assert resharded_from(meta, ParallelConfig(tp=2, pp=1, dp=1)) == "tp 1 x pp 1 x dp 2, ZeRO-1"
    assert resharded_from(meta, ParallelConfig(tp=1, pp=1, dp=2, zero=3)) == "tp 1 x pp 1 x dp 2, ZeRO-1"
    assert resharded_from({"layout": {"tp": 2, "pp": 2, "dp": 1}}, ParallelConfig(tp=2, pp=2, dp=1)) is None


def test_changed_effects_name_only_what_differs_from_an_uninterrupted_run():
    """Raising --steps changes the learning rates of the steps already made only past the warm-up (it was always
    'the batches or learning rates differ')."""
    saved = TrainConfig(steps=10, warmup=4).to_dict()
    more = TrainConfig(steps=20, warmup=4)
    assert changed_effects(saved, more, 4) == []  # 4 updates, all in the warm-up: the same rates
    assert changed_effects(saved, more, 6) == ["learning rates"]  # update 6 decayed over 10 steps, not 20
    assert changed_effects(saved, TrainConfig(steps=20, warmup=4, batch_size=8, clip=0.5), 2) == ["batches", "updates"]
    assert changed_effects(saved, TrainConfig(steps=10, warmup=4, seed=1, lr=1e-2), 1) == [
        "batches", "learning rates"]
    assert changed_effects(saved, TrainConfig.from_dict({**saved, "tp": 1, "pp": 4}), 6) == []


def test_resume_with_another_seq_len_says_it_does_not_continue_exactly(tmp_path, monkeypatch):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("some training text, repeated. " * 40)
    run_here(tmp_path, monkeypatch, steps=1, seq_len=16)
    printed = run_here(tmp_path, monkeypatch, steps=2, seq_len=32, resume=True, metrics="m.jsonl")
    out = " ".join(printed.split())  # the console wraps lines
    assert "resuming from plait-checkpoints/step_00000001 (step 1) note: --seq-len 16 -> 32, --steps 1 -> 2 since " \
           "that checkpoint was saved: this run's batches differ from an uninterrupted run's of these settings " \
           "(the checkpoint's settings continue it exactly)" in out, printed  # step 1 was in the warm-up
    row = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert row["step"] == 2 and row["tokens_seen"] == 2 * 16 + 2 * 32, row  # step 1 read 16-token windows
    assert "96 tokens seen" in out, printed


def test_a_layout_splitting_the_sequence_says_why_there_is_no_sample(tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("some training text, repeated. " * 40)
    res = subprocess.run([*RUN, "--tp", "2", "--sequence-parallel", "--steps", "1", "--seq-len", "16",
                          "--sample-tokens", "20"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    assert "no sample: --sequence-parallel splits each sequence, which decoding one token at a time cannot; plait " \
           "generate --model plait-checkpoints/step_00000001 samples the model" in " ".join(res.stdout.split())
    assert "sampling up to" not in res.stdout, res.stdout  # no sample is taken, so none is announced


def test_a_checkpoint_given_as_model_says_how_to_use_it(tmp_path):
    from typer.testing import CliRunner

    from plait.checkpoint.writer import FORMAT, META
    from plait.cli.main import app

    (tmp_path / "ck" / "step_00000004").mkdir(parents=True)
    (tmp_path / "ck" / "step_00000004" / META).write_text(f'{{"format": "{FORMAT}", "step": 4}}')
    res = CliRunner().invoke(app, ["train", "--model", str(tmp_path / "ck"), "--dry-run", "--cluster", "none"])
    assert res.exit_code == 2 and res.stderr.startswith(  # was 'not a preset (tiny, small) nor a Hugging Face folder'
        f"error: --model '{tmp_path / 'ck'}' is a plait checkpoint: continue its run with --resume --checkpoint-dir "
        f"{tmp_path / 'ck'}, or start a new run from its weights with `plait export {tmp_path / 'ck'} DIR`"), res.output


def test_max_data_mb_with_only_prepared_datasets_is_refused(tmp_path):
    from typer.testing import CliRunner

    from plait.cli.main import app
    from plait.data import prepare

    (tmp_path / "a.txt").write_text("some training text, repeated. " * 40)
    prepare([str(tmp_path / "a.txt")], "bytes", tmp_path / "d", workers=1, held_out=0.0)
    flags = ["train", "--data", f"1:{tmp_path / 'd'}", "--dry-run", "--cluster", "none"]
    res = CliRunner().invoke(app, [*flags, "--max-data-mb", "2"])  # was silently ignored
    assert res.exit_code == 2 and res.stderr.startswith(
        "error: --max-data-mb 2: it limits the plain text tokenized at start-up, but every --data is a prepared "
        "dataset"), res.output
    mixed = CliRunner().invoke(app, [*flags, "--data", str(tmp_path / "a.txt"), "--max-data-mb", "2"])
    assert "--max-data-mb" not in mixed.output, mixed.output  # read for the plain text


def test_the_header_says_starting_fresh_only_where_auto_resume_found_no_checkpoint():
    """--auto-resume: 'starting fresh' where no checkpoint was found; a resumed run says where it resumed from and
    nothing of starting fresh, whether or not its settings changed."""
    from types import SimpleNamespace

    from rich.console import Console

    from plait.parallel_config import ParallelConfig
    from plait.train.report import Reporter

    def header(resumed_from, saved=None, now=None, resharded=None):  # the checkpoint's settings and the run's
        console = Console(record=True, width=400, force_terminal=False)
        note = None if saved is None else resume_note(TrainConfig(**saved).to_dict(), TrainConfig.from_dict(now), 4)
        run = SimpleNamespace(pm=SimpleNamespace(family=SimpleNamespace(name="llama")), params=1e6,
                              ctx=SimpleNamespace(config=ParallelConfig()),
                              data=SimpleNamespace(describe=lambda *_: "d"), start=4 if resumed_from else 0,
                              resumed_from=resumed_from, resume_note=note, passed_over=[], resharded_from=resharded,
                              prediction=None, unpredicted=None)
        Reporter(TrainConfig(auto_resume=True, metrics=None), 0, console).begin(run)
        return console.export_text()

    fresh, same = header(None), header("ck/step_4", {"seed": 1}, {"seed": 1, "tp": 1, "pp": 4}, "tp 2 x pp 2 x dp 1")
    changed = header("ck/step_4", {"seed": 0}, {"seed": 1})
    longer = header("ck/step_4", {"steps": 300}, {"steps": 400})  # no update of steps 1-4 got another rate
    assert "starting fresh" in fresh and "resuming from" not in fresh, fresh
    for out in (same, changed, longer):
        assert "resuming from ck/step_4 (step 4)" in out and "starting fresh" not in out, out
    assert "note: --seed 0 -> 1 since that checkpoint was saved: this run's batches differ" in changed, changed
    assert "since that checkpoint" not in same, same  # a layout reshards: no setting of CONTINUED changed
    assert "resuming from ck/step_4 (step 4), saved under tp 2 x pp 2 x dp 1: its weights and optimizer state " \
           "resharded to this layout" in same, same
    assert "saved under" not in changed, changed
    assert "note:" not in longer and "differ" not in longer, longer
    assert "--steps 300 -> 400 since that checkpoint was saved: the run goes on as an uninterrupted run of these " \
           "settings would" in " ".join(longer.split()), longer


def test_a_batch_with_no_target_in_the_chat_loss_mask_shows_no_loss_not_zero(tmp_path, monkeypatch):
    """Chat data whose assistant replies are a few bytes in long conversations: most 16-token windows hold no
    assistant token. Such a step's loss is no mean (0 of 0 targets): its row says null, not 0.0, the summary names
    the steps, and held-out batches without a target in the loss give no held-out loss, not 0.000."""
    from plait.data import prepare
    from plait.data.chat import ChatSpec

    words = "alpha beta gamma delta epsilon".split()
    with open(tmp_path / "chats.jsonl", "w") as f:
        for i in range(24):
            user = " ".join(words[(i + j) % 5] for j in range(60))
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": "ok"}]}) + "\n")
    prepare([str(tmp_path / "chats.jsonl")], "bytes", tmp_path / "d", workers=1, held_out=0.3,
            chat=ChatSpec("bytes"))
    printed = run_here(tmp_path, monkeypatch, data=["d"], seq_len=16, steps=6, eval_every=3, metrics="m.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    empty = [r["step"] for r in rows if r["loss"] is None]
    assert empty and all(r["grad_norm"] == 0.0 for r in rows if r["loss"] is None), rows  # was loss 0.0
    assert all(r["loss"] > 1.0 for r in rows if r["loss"] is not None), rows
    out = " ".join(printed.replace("│", " ").split())  # the summary table wraps its cells
    assert "loss - (no target in the loss)" in out, printed
    steps = f"{len(empty)} step{'s' if len(empty) != 1 else ''}"
    which = f"step{'s' if len(empty) != 1 else ''} {', '.join(map(str, empty))}"
    assert f"{steps} had no target in the loss ({which}:" in out, printed
    assert [r["held_out_loss"] for r in rows if "held_out_loss" in r] == [None, None], rows  # was 0.0
    assert "held-out loss - (no held-out target in the loss)" in out, printed
    meta = json.loads((tmp_path / "plait-checkpoints" / "step_00000006" / "meta.json").read_text())
    assert meta["tokenizer"]["eos"] == 0  # the data's end-of-document token: where generate and serve stop


def test_a_warmup_as_long_as_the_run_is_named_and_one_process_is_singular():
    """--warmup 20 (the default) with --steps 5: the learning rate never reaches --lr, which the header says."""
    from types import SimpleNamespace

    from rich.console import Console

    from plait.parallel_config import ParallelConfig
    from plait.train.report import Reporter

    def header(**kw):
        console = Console(record=True, width=400, force_terminal=False)
        run = SimpleNamespace(pm=SimpleNamespace(family=SimpleNamespace(name="llama")), params=1e6,
                              ctx=SimpleNamespace(config=ParallelConfig(tp=1, pp=1, dp=1)),
                              data=SimpleNamespace(describe=lambda *_: "d"), start=0, resumed_from=None,
                              resume_note=None, passed_over=[], resharded_from=None, prediction=None,
                              unpredicted=None)
        Reporter(TrainConfig(metrics=None, **kw), 0, console).begin(run)
        return console.export_text()

    short = header(steps=5, warmup=20, lr=3e-3)
    assert "note: --warmup 20 is not shorter than --steps 5: the learning rate rises the whole run, to 25% of " \
           "--lr 0.003 at its last step, and never decays (give --warmup below --steps)" in short, short
    assert "(1 process)," in short, short  # was "(1 processes)"
    assert "--warmup" not in header(steps=300, warmup=20), "a warm-up shorter than the run is no news"


def test_the_layout_line_names_a_pipeline_schedule_only_where_there_is_a_pipeline():
    from plait.parallel_config import ParallelConfig
    from plait.train.report import layout_text

    assert layout_text(ParallelConfig(tp=2, pp=1, dp=1, microbatches=1)) == \
        "tp 2 x pp 1 x dp 1 (2 processes), 1 micro-batch"  # was "..., 1f1b, 1 micro-batches"
    assert layout_text(ParallelConfig(tp=1, pp=2, dp=1, microbatches=4, schedule="interleaved-1f1b",
                                      virtual_stages=2)) == \
        "tp 1 x pp 2 x dp 1 (2 processes), interleaved-1f1b V=2, 4 micro-batches"


def test_the_summary_of_a_run_stopped_by_a_signal_names_the_stop_not_a_missing_target():
    """A run stopped by Ctrl-C after step 139 of 200 measures no held-out loss (it leaves promptly): its summary
    says so and shows the steps it ran, not '1..200' and '(no held-out target in the loss)' of a text dataset."""
    from types import SimpleNamespace

    from rich.console import Console

    from plait.parallel_config import ParallelConfig
    from plait.train.loop import TrainResult
    from plait.train.report import summary_table

    def rows(res: TrainResult) -> str:
        run = SimpleNamespace(ctx=SimpleNamespace(config=ParallelConfig(tp=1, pp=2, dp=1)), start=0, prediction=None,
                              unpredicted=None, data=SimpleNamespace(eval_order=[0], position=lambda steps: {
                                  "tokens_seen": steps * 512, "epoch": 0.5}))
        console = Console(record=True, width=400, force_terminal=False)
        console.print(summary_table(TrainConfig(steps=200), run, res))
        return " ".join(console.export_text().replace("│", " ").split())

    stopped = rows(TrainResult(losses={1: 5.5, 139: 0.5}, stopped_at=139, stop_signal="SIGINT"))
    assert "steps 1..139 (stopped by SIGINT; --steps 200)" in stopped, stopped
    assert "held-out loss - (not measured: stopped by SIGINT)" in stopped, stopped
    assert "71,168 tokens seen" in stopped, stopped
    done = rows(TrainResult(losses={1: 5.5, 200: 0.5}, held_out=0.7))
    assert "steps 1..200 loss" in done and "held-out loss 0.700" in done, done


def test_what_follows_the_last_step_is_said_before_it_is_done(tmp_path):
    """The last checkpoint's save, the held-out loss and the sample take a minute or more for a large model, after
    the last step's line: the log says what the run does, before the summary (it was silent until then). Each save
    written in the loop (--no-async-checkpoint), during the run too, then says what it saved where, how big."""
    import io

    from rich.console import Console

    import plait.train.loop as loop
    from data_util import write_jsonl
    from plait.data import prepare
    from plait.train.report import Reporter

    src = write_jsonl(tmp_path / "c.jsonl", [f"document {i}: some words to train on. " * 4 for i in range(40)])
    prepare([str(src)], "bytes", tmp_path / "d", workers=1, held_out=0.3)
    cfg = TrainConfig.from_dict(dict(tp=1, pp=1, dp=1, microbatches=1, seq_len=16, batch_size=2, steps=2, warmup=1,
                                     eval_every=0, sample_tokens=4, trace_every=0, data=[str(tmp_path / "d")],
                                     checkpoint_every=1, async_checkpoint=False, checkpoint_dir=str(tmp_path / "ck")))
    log = io.StringIO()
    loop.train(cfg, reporter=Reporter(cfg, 0, Console(file=log, width=200)))
    lines = log.getvalue().splitlines()
    _check_saves(lines, tmp_path / "ck", (1, 2), background=False)  # during the run (said nothing) and the last
    said = [f"saving the checkpoint of step 2 in {tmp_path / 'ck'} ...", "measuring the held-out loss ...",
            "sampling up to 4 tokens ..."]
    at = [lines.index(s) for s in said]
    last_step = max(i for i, line in enumerate(lines) if line.startswith("step "))
    summary = next(i for i, line in enumerate(lines) if "plait train: summary" in line)
    assert last_step < at[0] < at[1] < at[2] < summary, lines



def _check_saves(lines: list[str], ck, steps: tuple[int, ...], background: bool) -> None:
    """Each save of ``steps`` is said before it starts and once saved (or being written), naming its folder and its
    size (the size of its shard files, in MB)."""
    for step in steps:
        folder = ck / f"step_{step:08d}"
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6
        i = lines.index(f"saving the checkpoint of step {step} in {ck} ...")
        said = f"writing {folder} in the background" if background else f"saved {folder}"
        assert lines[i + 1] == f"{said} ({size:,.0f} MB of weights and optimizer state)", lines


def test_each_save_in_the_background_says_what_it_saves_where_and_how_big(tmp_path):
    """As each save written in the loop (test_what_follows_the_last_step_is_said_before_it_is_done), a save during
    the run and the last one, written in the background (--async-checkpoint), each say what they save where (the
    saves during the run said nothing)."""
    import io

    from rich.console import Console

    import plait.train.loop as loop
    from data_util import write_jsonl
    from plait.data import prepare
    from plait.train.report import Reporter

    src = write_jsonl(tmp_path / "c.jsonl", [f"document {i}: some words to train on. " * 4 for i in range(40)])
    prepare([str(src)], "bytes", tmp_path / "d", workers=1)
    cfg = TrainConfig.from_dict(dict(tp=1, pp=1, dp=1, microbatches=1, seq_len=16, batch_size=2, steps=2, warmup=1,
                                     eval_every=0, sample_tokens=0, trace_every=0, data=[str(tmp_path / "d")],
                                     checkpoint_every=1, async_checkpoint=True, checkpoint_dir=str(tmp_path / "ck")))
    log = io.StringIO()
    loop.train(cfg, reporter=Reporter(cfg, 0, Console(file=log, width=200)))
    _check_saves(log.getvalue().splitlines(), tmp_path / "ck", (1, 2), background=True)


def test_a_held_out_split_shorter_than_a_window_is_named_not_called_missing(tmp_path):
    """Documents held out (here 3 of 40, 39 tokens) but fewer tokens than one --seq-len + 1 window: the run
    measures no held-out loss, and the data line and the summary say why instead of 'no held-out split'."""
    from types import SimpleNamespace

    from rich.console import Console

    from plait.data import prepare
    from plait.data.stream import open_data
    from plait.parallel_config import ParallelConfig
    from plait.train.loop import TrainResult
    from plait.train.report import summary_table

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i:03d}"}) + "\n" for i in range(40)))
    prepare([str(tmp_path / "docs.jsonl")], "bytes", tmp_path / "d", workers=1, held_out=0.1)
    data = open_data([str(tmp_path / "d")], "tiny", 256, 64, 2, 0, 1)
    held = data.sources[0].held_out.tokens
    assert 0 < held <= 64 and data.eval_order is None, held  # held-out tokens, but not 65 of them
    assert f"{held} held out, fewer than one 65-token window: no held-out loss)" in data.describe(), data.describe()
    run = SimpleNamespace(ctx=SimpleNamespace(config=ParallelConfig(tp=1, pp=1, dp=1)), start=0, prediction=None,
                          unpredicted=None, data=data)
    console = Console(record=True, width=400, force_terminal=False)
    console.print(summary_table(TrainConfig(steps=2, seq_len=64), run, TrainResult(losses={1: 5.5, 2: 5.0})))
    out = " ".join(console.export_text().replace("│", " ").split())
    assert (f"held-out loss - (the held-out split's {held} tokens make no 65-token window: a shorter --seq-len, or "
            "a larger --held-out in plait data prepare)") in out, out  # was "(no held-out split)"
    assert "no held-out split" not in out and "no held-out loss" not in open_data(
        [str(tmp_path / "d")], "tiny", 256, 8, 2, 0, 1).describe()
