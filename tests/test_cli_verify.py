"""`plait verify` launches its own CPU world, prints a verdict, and rejects bad layouts in one line.

A bad layout is refused in the command itself, before anything launches: those cases run the command in this
process (typer's runner: the same code path, exit code and stderr) instead of paying a fresh interpreter and
torch import each. One passing run goes through ``python -m plait.cli.main`` as a user runs it; the other
passing runs go through the runner too (the command still launches its own world of fresh processes)."""

import json
import re
import subprocess
import sys

from typer.testing import CliRunner, Result

from plait.cli.main import app


def _plait(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plait.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def _in_process(*args: str) -> Result:
    return CliRunner().invoke(app, ["verify", *args])


def test_verify_json_passes_for_pp2_zb_h1_with_selective_recompute():
    proc = _plait("verify", "--tp", "1", "--pp", "2", "--schedule", "zb-h1", "--microbatches", "4",
                  "--layers", "4", "--batch-size", "4", "--recompute", "selective", "--json", "--trace")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert "makespan: measured" in out["trace"] and "rank 1 |" in out["trace"]  # --trace was ignored with --json
    assert out["ok"] is True
    assert out["config"]["recompute"] == "selective"
    assert out["loss_rel"] <= 1e-5
    assert len(out["grads"]) == 4 * 9 + 3 and all(g["ok"] for g in out["grads"])
    assert out["peak_measured"] == out["peak_simulated"]


def test_verify_bad_layout_is_one_line():
    res = _in_process("--tp", "3", "--pp", "1")
    assert res.exit_code == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "n_heads" in lines[0], res.stderr
    assert res.stdout == "", res.stdout


def test_verify_settings_are_named_as_flags():
    """Every refusal names the flags typed (--layers, not n_layers; --seq-len, not LlamaConfig.max_seq_len), before
    anything launches."""
    for args, needle in ((["--batch-size", "7"], "--batch-size 7: must split into --dp 1 replicas of --microbatches 8 "
                                                 "micro-batches each: valid 8, 16, 24, ...; or, instead of "
                                                 "--microbatches 8, one that divides a replica's 7 sequences: 1 or 7"),
                         (["--dp", "3", "--tp", "1", "--pp", "1"], "--batch-size 16: must split into --dp 3 replicas "
                                                                   "of --microbatches 8 micro-batches each: valid 24, "
                                                                   "48, 72, ...\n"),
                         (["--seq-len", "0"], "--seq-len 0: must be >= 1"),
                         (["--layers", "3", "--pp", "2", "--schedule", "zbv"], "--layers 3: fewer than the 4 pipeline "
                                                                               "chunks (pp x virtual stages), each of "
                                                                               "which needs a layer: valid 4 or more"),
                         (["--top-k", "3"], "--top-k 3: must be between 1 and the experts (--experts 1)"),
                         (["--experts", "0"], "--experts 0: must be >= 1"),
                         (["--zero", "1"], "--zero 1: shards only the optimizer's state"),
                         (["--experts", "3", "--ep", "2"], "--ep 2: must divide --experts 3: each EP rank holds an "
                                                          "equal share of the experts; valid: [1, 3]"),
                         (["--tp", "2", "--dp", "1", "--experts", "4", "--ep", "2", "--expert-tp"],
                          "--ep 2: must divide --dp 1 with --expert-tp (every TP rank holds a shard"),
                         (["--tp", "2", "--expert-tp"], "--expert-tp: needs a mixture-of-experts model, at least 2 "
                                                        "experts (not --experts 1)"),
                         (["--dp", "2", "--ep", "2"], "--ep 2: needs a mixture-of-experts model, at least 2 experts "
                                                      "(not --experts 1)"),
                         (["--cp-comm", "ring"], "--cp-comm ring: how context-parallel ranks exchange keys and "
                                                 "values, but --cp is 1"),  # was silently ignored
                         (["--tp", "3"], "--tp 3: does not fit plait verify's model (tp=3 must divide n_heads=4"),
                         (["--window", "0"], "--window 0: must be an integer >= 1"),
                         (["--document-mask", "--experts", "2"], "--document-mask: compares each document run alone, "
                                                                 "but a mixture of experts' load-balancing loss is the "
                                                                 "packed row's: use --experts 1 (not --experts 2)"),
                         (["--cp", "2", "--seq-len", "6"], "--seq-len 6: must be a multiple of 4 under --cp 2 (2·cp "
                                                           "chunks of equal length); valid lengths: 4, 8, 12, ..., "
                                                           "the nearest 4 or 8")):
        res = _in_process(*args)
        assert res.exit_code == 2 and res.stderr.startswith(f"error: {needle}"), (args, res.output)


def test_verify_unknown_schedule():
    res = _in_process("--schedule", "2f2b")
    assert res.exit_code == 2 and "schedule" in res.stderr and "Traceback" not in res.output, res.output


def test_verify_mixture_of_experts_with_expert_parallelism():
    res = _in_process("--tp", "2", "--pp", "1", "--experts", "4", "--top-k", "2", "--ep", "2",
                      "--layers", "2", "--batch-size", "4", "--microbatches", "2", "--json")
    assert res.exit_code == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["ok"] is True and out["config"]["ep"] == 2
    assert any(".mlp.experts.3." in g["name"] for g in out["grads"]), "expert gradients were not compared"


def test_verify_experts_tensor_parallel_inside():
    res = _in_process("--tp", "2", "--pp", "1", "--dp", "2", "--experts", "4", "--top-k", "2", "--ep", "2",
                      "--expert-tp", "--layers", "2", "--batch-size", "4", "--microbatches", "2", "--json")
    assert res.exit_code == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["ok"] is True and out["config"]["expert_tp"] is True


def test_verify_forks_its_processes_from_a_server_that_imported_torch(monkeypatch):
    """A check's processes are forked from the launcher's fork server, which imported torch and the check's modules
    once, instead of each importing them (plait demo's two checks: ~20 s -> ~12 s on 2 cores)."""
    from plait.distributed import launch
    from plait.verify import VerifyConfig, verify

    seen: dict = {}

    def fake_run_world(fn, nprocs, *args, **kw):
        seen.update(kw, nprocs=nprocs)
        return ["rank 0's result"]

    monkeypatch.setattr(launch, "run_world", fake_run_world)
    assert verify(VerifyConfig()) == "rank 0's result"
    assert seen["nprocs"] == 4 and {"torch", "plait.verify"} <= set(seen.get("preload", ())), seen


def test_the_gradient_table_names_every_tensor_whole_at_80_columns():
    """An expert's weight (layers.7.mlp.experts.3.down_proj.weight) was cut to 'layers.7.mlp.experts.3.down_proj.weig…'
    in an 80-column terminal or a log; a long name now folds onto the next line of its cell."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from plait.cli.verify import result_table

    names = [f"layers.{i}.mlp.experts.{e}.{p}_proj.weight" for i in (7, 11) for e in (2, 3) for p in ("gate", "down")]
    grads = [SimpleNamespace(name=n, shape=(176, 64), max_abs=3e-10, rel=4e-7, ok=i != 3) for i, n in enumerate(names)]
    console = Console(file=io.StringIO(), width=80)
    console.print(result_table(SimpleNamespace(grads=grads)))
    text = console.file.getvalue()
    assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
    shown: list[str] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) != 5 or cells[0] in ("", "tensor"):
            continue
        if cells[3]:  # a row's first line carries its figures
            shown.append(cells[0])
        else:  # the rest of a folded name
            shown[-1] += cells[0]
    assert shown == names, text
    assert "MISMATCH" in text


def test_verify_trace_into_a_pipe_folds_no_line():
    """Into a file or a pipe no line is folded (rich would fold at an assumed 80 columns): a chart's header keeps
    its end ('...; one column = 0.5') and the loss line its 'eval logits rel' on the same line."""
    res = _in_process("--tp", "1", "--pp", "2", "--layers", "2", "--batch-size", "4", "--microbatches", "4",
                      "--trace")
    assert res.exit_code == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    headers = [line for line in lines if line.startswith("1f1b: 2 ranks x 1 chunk, 4 micro-batches; makespan")]
    assert len(headers) == 2 and all(h.rstrip().endswith(tuple("0123456789")) and "one column = " in h
                                     for h in headers), res.stdout
    assert any(line.startswith("loss: parallel") and "eval logits rel" in line for line in lines), res.stdout
    assert any(line.startswith("makespan: measured") and "predicted" in line for line in lines), res.stdout
    rows = [line for line in lines if line.startswith("rank ")]
    assert len(rows) == 4 and len({len(r) for r in rows[:2]}) == 1, res.stdout


def test_the_verdict_says_what_was_compared_how_close_and_what_differs(monkeypatch):
    """The last line said 'PASS: parallel equals single device', or 'FAIL' alone, even when every gradient read ok
    and only a peak of activations differed. It now names each comparison with the single-device run against its
    tolerance (the worst gradient by name), and a FAIL names what differs, first."""
    import plait.verify
    from plait.verify import TensorError, VerifyConfig, VerifyResult

    grads = [TensorError("tok_embeddings.weight", (256, 64), 1e-9, 3e-7),
             TensorError("layers.1.mlp.up_proj.weight", (176, 64), 2e-9, 9e-7)]
    good = VerifyResult(VerifyConfig(), 5.5, 5.5 * (1 + 5e-9), grads, 4e-7, [2.0, 1.0], [2.0, 1.0])
    assert good.ok and good.verdict() == (
        "PASS: parallel equals single device: loss rel 5.0e-09 <= 1e-05; 2 gradients within rel 1e-04 (worst "
        "layers.1.mlp.up_proj.weight rel 9.0e-07); eval logits rel 4.0e-07 <= 1e-05; peak stored activations per "
        "pipeline rank equal the simulator's")
    bad = VerifyResult(VerifyConfig(), 5.5, 5.5, [grads[0], TensorError("norm.weight", (64,), 1e-3, 2e-2)], 4e-7,
                       [3.0, 1.0], [2.0, 1.0])
    assert not bad.ok and bad.verdict() == (
        "FAIL: parallel differs from single device: 1 of 2 gradients beyond rel 1e-04 (worst norm.weight rel "
        "2.0e-02); peak stored activations per pipeline rank [3.0, 1.0], the simulator's [2.0, 1.0]")
    assert json.loads(json.dumps(bad.to_dict()))["verdict"] == bad.verdict()
    monkeypatch.setattr(plait.verify, "verify", lambda cfg: bad)  # the command's own rendering, nothing launched
    res = _in_process("--tp", "1", "--pp", "2", "--layers", "2")
    assert res.exit_code == 1 and res.stdout.splitlines()[-1] == bad.verdict(), res.stdout


LONG_CONTEXT = ("--tp", "1", "--pp", "1", "--dp", "1", "--cp", "2", "--cp-comm", "ring", "--document-mask",
                "--window", "4", "--seq-len", "32", "--layers", "2", "--batch-size", "4", "--microbatches", "2")


def test_verify_long_context_cp2_ring_with_documents_and_a_window():
    """A windowed, document-masked layout over cp=2 (ring) equals each document run alone through the plain model."""
    res = _in_process(*LONG_CONTEXT, "--json")
    assert res.exit_code == 0, res.output[-2000:]
    out = json.loads(res.stdout)
    assert out["ok"] is True and out["verdict"].startswith("PASS"), out["verdict"]
    assert out["config"]["cp"] == 2 and out["config"]["document_mask"] is True and out["config"]["window"] == 4


def test_the_long_context_batch_packs_documents_and_the_model_takes_the_window():
    from plait.verify import EOS, VerifyConfig, _batch, _model_config

    cfg = VerifyConfig(document_mask=True, window=4, seq_len=32, batch_size=4)
    inputs, targets = _batch(cfg)
    assert inputs.shape == targets.shape == (4, 32)
    assert all(int((row[:-1] == EOS).sum()) >= 2 for row in inputs), inputs  # 3 or more documents a row
    assert int((_batch(VerifyConfig(seq_len=32, batch_size=4))[0] == EOS).sum()) <= 4  # no planting without the flag
    assert _model_config(cfg).sliding_window == 4 and _model_config(VerifyConfig()).sliding_window is None


def _rank_without_the_document_mask(cfg):
    """plait verify's rank with document masking broken: every micro-batch's attention spans its whole rows."""
    from plait.documents import Documents
    from plait.verify import _rank_main

    Documents.start = lambda self, inputs: None  # type: ignore[method-assign]  # this throwaway process only
    return _rank_main(cfg)


def test_verify_fails_naming_the_tensor_when_the_document_mask_is_broken(monkeypatch):
    from plait.distributed import launch

    real = launch.run_world
    monkeypatch.setattr(launch, "run_world", lambda fn, *a, **kw: real(_rank_without_the_document_mask, *a, **kw))
    res = _in_process(*LONG_CONTEXT)
    assert res.exit_code == 1, res.output[-2000:]
    verdict = res.stdout.splitlines()[-1]
    assert verdict.startswith("FAIL: parallel differs from single device: ") and "MISMATCH" in res.stdout, verdict
    worst = re.search(r"gradients beyond rel 1e-04 \(worst (\S+) rel", verdict)
    assert worst and re.search(rf"│ {re.escape(worst[1])} +│.*MISMATCH", res.stdout), verdict  # a tensor of the table
