"""The planner counts document masking's memory (plait.plan.documents): what it predicts for a run with
--document-mask is what the run's meter measures, on the path the planner counts (the mask, or each document
alone), and the prediction's memory line says which. Its step time costs the attention path the documents take,
as the data (plait train --dry-run) or a mean length (plait plan --mean-document-length) says they cut the rows."""

from __future__ import annotations

import pytest
import torch

import checks_documents as cd
import plait
from plait.errors import ConfigError
from plait.models import Llama
from plait.parallel_config import ParallelConfig
from plait.plan import Layout, Model, Training
from plait.plan import memory as mem
from plait.plan.cluster import Cluster
from plait.plan.documents import note


def planned(cfg, rows: int, document_mask: bool, recompute: str) -> float:
    """The planner's activation peak (what autograd saves, the recomputed layer's working set aside) of one
    micro-batch of ``rows`` x ``cfg.max_seq_len`` on one process (plait's eager runtime's count, fp32)."""
    model = Model.from_llama_config(cfg.to_dict(), cfg.max_seq_len)
    layout = Layout.from_parallel_config(ParallelConfig(microbatches=1, recompute=recompute).resolve(1), rows)
    training = Training(rows, precision="fp32", elementwise="plait-eager", document_mask=document_mask)
    acts = mem.activations(Cluster("h200", 1, gpus_per_node=1), model, layout, training)
    return acts.chunk(model.n_layers, True, True) + acts.shared


def measured(cfg, tokens: torch.Tensor, eos: int | None, recompute: str) -> int:
    with plait.init(1, 1, 1) as ctx:
        torch.manual_seed(0)
        par = ParallelConfig(microbatches=1, recompute=recompute)
        pm = plait.parallelize(Llama(cfg), ctx, config=par, document_eos=eos)
        pm.train_step(tokens[:, :-1], tokens[:, 1:], measure_memory=True)
        return pm.activations_peak


# "mask": one long row of 128 two-token documents (past SPLIT_MAX), one layer: the planner counts the [1, 1, S, S]
# mask, the larger path. "each": two rows of a few documents, four layers, 64 tokens (too few to hold more than
# SPLIT_MAX documents, so no mask can occur): it counts each document alone, one q-sized tensor a layer (none
# under selective recomputation). Under full recomputation the checkpoints keep their inputs only: nothing more
# is saved (the recomputed layer's working set holds it).
CASES = {"mask": (dict(max_seq_len=256, n_layers=1), 1, range(1, 256, 2)),
         "each": (dict(max_seq_len=32, n_layers=4), 2, (9, 20))}


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("path", list(CASES))
def test_predicted_activations_under_document_mask_are_measured(path, recompute):
    kw, rows, eos_at = CASES[path]
    cfg = cd.model_config(**kw)
    tokens = torch.randint(1, cfg.vocab_size, (rows, cfg.max_seq_len + 1), generator=torch.Generator().manual_seed(5))
    tokens[:, list(eos_at)] = cd.EOS
    plain, masked = measured(cfg, tokens, None, recompute), measured(cfg, tokens, cd.EOS, recompute)
    assert masked > plain or recompute == "full"  # the masked step keeps more: the prediction must count it
    assert planned(cfg, rows, False, recompute) == pytest.approx(plain, rel=1e-3)
    assert planned(cfg, rows, True, recompute) == pytest.approx(masked, rel=1e-3)
    model = Model.from_llama_config(cfg.to_dict(), cfg.max_seq_len)
    said = note(model, Layout.from_parallel_config(ParallelConfig(microbatches=1).resolve(1), rows))
    assert ("the mask [b, 1, S, S]" in said) == (path == "mask") and ("each document alone" in said) == (path == "each")


def test_train_dry_run_counts_document_mask(tmp_path):
    """`plait train --dry-run --document-mask` predicts the masked run's activations (more than without) and its
    memory note says which attention path they count; its step time costs attention as the documents of --data cut
    the rows, and the note says so."""
    import json

    from typer.testing import CliRunner

    from data_util import documents, write_jsonl
    from plait.cli.main import app
    from plait.data.prepare import prepare
    from profile_util import synthetic_profile

    path = synthetic_profile(counts=(1,), block=True).save(tmp_path / "host.toml")
    prepare([str(write_jsonl(tmp_path / "d.jsonl", documents(400, max_words=6)))], "bytes", tmp_path / "data",
            workers=1, held_out=0.1)
    flags = ["--model", "tiny", "--seq-len", "128", "--batch-size", "4", "--tp", "1", "--pp", "1", "--dp", "1",
             "--dry-run", "--cluster", str(path), "--data", str(tmp_path / "data")]
    rows = {}
    for mask in (False, True):
        metrics = tmp_path / f"{mask}.jsonl"
        r = CliRunner().invoke(app, ["train", *flags, "--metrics", str(metrics), *(["--document-mask"] * mask)])
        assert r.exit_code == 0, r.output
        rows[mask] = json.loads(metrics.read_text())
        assert any("--document-mask" in n for n in rows[mask]["memory"]["notes"]) == mask
    said = " ".join(r.output.split())
    assert "each document alone" in said and f"the documents of {tmp_path / 'data'}" in said
    peaks = {mask: row["memory"]["predicted"][0]["activations_peak"] for mask, row in rows.items()}
    # 4 micro-batches of 1 x 128, one in flight: per-row tables (none beyond the shared pair at b = 1) and one
    # q-sized [1, 128, 128] fp32 tensor in each of tiny's 4 layers
    assert peaks[True] - peaks[False] == pytest.approx(4 * 128 * 128 * 4)
    assert rows[True]["predicted_step_time_s"] != pytest.approx(rows[False]["predicted_step_time_s"], rel=1e-3)


# ------------------------------------------------------------------------------------------------ step time
def test_the_pieces_a_row_holds_are_those_of_the_packed_stream():
    """``DocumentLengths.of_mean`` (documents of one length, rows at any offset) and ``plait.data.lengths`` (a
    dataset's documents, rows where plait.data.stream cuts them) against the rows themselves, cut at each EOS as
    plait.documents cuts them."""
    import numpy as np

    from plait.data.lengths import window_documents
    from plait.plan.documents import DocumentLengths

    def cut(row: np.ndarray) -> list[int]:  # the documents of one row of inputs, as Documents.start cuts them
        ends = [0, *(np.flatnonzero(row[:-1] == 0) + 1).tolist(), len(row)]
        return [b - a for a, b in zip(ends, ends[1:], strict=False)]

    for length, s in ((5, 16), (16, 16), (40, 16), (7, 50)):
        stream = np.tile(np.r_[np.ones(length - 1), 0], 4 * (s + length))  # documents of `length`, EOS last
        rows = [cut(stream[p:p + s]) for p in range(length)]  # every offset of one period
        mean = DocumentLengths.of_mean(length, s)
        assert mean.count == pytest.approx(np.mean([len(r) for r in rows]))
        assert mean.squares == pytest.approx(np.mean([sum(x * x for x in r) for r in rows]))
    lengths = np.random.default_rng(0).integers(1, 90, 400)
    stream = np.ones(int(lengths.sum()))
    stream[np.cumsum(lengths) - 1] = 0
    s = 64
    rows = [cut(stream[w * s:w * s + s]) for w in range((len(stream) - 1) // s)]
    count, squares = window_documents(np.r_[0, np.cumsum(lengths)[:-1]], len(stream), s)
    assert count == pytest.approx(np.mean([len(r) for r in rows]))
    assert squares == pytest.approx(np.mean([sum(x * x for x in r) for r in rows]))


def layer_seconds(cluster, model, documents, microbatch: int = 1) -> float:
    """A layer's forward + backward compute on ``cluster`` (one process), masked as ``documents`` cut the rows."""
    from plait.plan.timing import layer_blocks

    training = Training(microbatch, precision="fp32", document_mask=documents is not None, documents=documents)
    layer = layer_blocks(cluster.costs, model, Layout(microbatch_size=microbatch), training).layer
    return layer.f_compute + layer.b_compute


def clusters(tmp_path):
    from profile_util import synthetic_profile

    host = Cluster.from_profile(synthetic_profile(counts=(1,), block=True, layers=True).save(tmp_path / "h.toml"), 1)
    return {"h100": Cluster("h100-sxm", 1, gpus_per_node=1), "host": host}


def test_attention_under_the_mask_costs_less_as_documents_shorten(tmp_path):
    """Each document alone (few enough documents a micro-batch): the predicted layer time falls with the documents'
    length, on the GPU model and on a calibrated host, below the unmasked layer's."""
    from plait.plan.documents import DocumentLengths, attention_path

    model = Model.preset("llama3-8b", seq_len=2048)
    for name, cluster in clusters(tmp_path).items():
        times = [layer_seconds(cluster, model, None)]
        for mean in (2048, 512, 128, 64):
            docs = DocumentLengths.of_mean(mean, model.seq_len)
            assert attention_path(docs, Layout()) == "each"
            times.append(layer_seconds(cluster, model, docs))
        assert all(a > b for a, b in zip(times, times[1:], strict=False)), (name, times)


def test_the_mask_path_costs_the_dense_square_and_the_mask(tmp_path):
    """More documents a micro-batch than plait.documents.SPLIT_MAX: one call over the whole rows with the additive
    mask. GPU: the whole square at the fused kernel's published speed where the causal kernel computes half, and
    the mask read from HBM once a pass for each head, exactly. Host: the calibration's causal attention over the
    share torch's CPU kernel computes of the square, and the mask read once a pass in the element-wise work."""
    from plait.plan.attention import efficiency
    from plait.plan.documents import DocumentLengths, attention_path, causal_share, masked_attention
    from plait.plan.gpu import FLASH_BACKWARD, FLASH_CAUSAL
    from plait.plan.host import census
    from plait.plan.host.documents import masked_work

    model, b = Model.preset("llama3-8b", seq_len=2048), 2
    docs = DocumentLengths.of_mean(32, model.seq_len)
    assert attention_path(docs, Layout(microbatch_size=b)) == "mask"
    found = clusters(tmp_path)
    gpu = found["h100"].gpu
    flops = 4 * b * model.seq_len ** 2 * model.q_width
    core = flops * (1 - FLASH_CAUSAL) / (gpu.peak_flops * efficiency(gpu, "flash2", model.seq_len, model.head_dim))
    mask = b * model.n_heads * model.seq_len ** 2 * 4 / gpu.memory_bandwidth  # fp32 here
    added = layer_seconds(found["h100"], model, docs, b) - layer_seconds(found["h100"], model, None, b)
    assert added == pytest.approx((1 + FLASH_BACKWARD) * core + 2 * mask, rel=1e-9)
    assert [causal_share(s, "cpu") for s in (128, 512, 1024, 2048)] == [1.0, 1.0, 0.75, 0.625]
    sh = census.local(model, Layout(microbatch_size=b))
    plain = census.layer_work(sh, 4)
    masked = masked_work(plain, docs, masked_attention(docs, model, Layout(microbatch_size=b), 4),
                         Layout(microbatch_size=b), sh, 4, "cpu")
    assert masked.attention == pytest.approx(plain.attention / 0.625)
    assert masked.elem_bytes - plain.elem_bytes == pytest.approx(2 * b * model.seq_len ** 2 * 4)  # once a pass
    assert layer_seconds(found["host"], model, docs, b) > layer_seconds(found["host"], model, None, b)
    with pytest.raises(ConfigError, match="documents: lengths of rows of 1024 tokens, for a model of seq_len 2048"):
        layer_seconds(found["h100"], model, DocumentLengths.of_mean(32, 1024), b)


def test_plan_document_mask_costs_the_assumed_documents(tmp_path):
    """`plait plan --document-mask --mean-document-length N`: the best layout's step as documents of N tokens cut
    the rows (shorter documents, less attention, until the mask path), said in the output and carried to the
    flags and --write-config; either option without the other is a one-line error naming what to give."""
    import json

    import tomllib
    from typer.testing import CliRunner

    from plait.cli.main import app

    runner = CliRunner()
    flags = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "64", "--top", "1"]
    steps = {}
    for mean in (None, 4096, 600, 16):
        words = [] if mean is None else ["--document-mask", "--mean-document-length", str(mean)]
        r = runner.invoke(app, [*flags, *words, "--json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.output)
        steps[mean] = out["best"][0]["step_time_s"]
        assert ("--document-mask" in out["train_flags"]) == (mean is not None)
        assert (out["document_mask"] is None) == (mean is None)
    assert steps[None] > steps[4096] > steps[600] and steps[16] > steps[None]  # 16: past SPLIT_MAX, the mask
    r = runner.invoke(app, [*flags, "--document-mask", "--mean-document-length", "600", "--write-config",
                            str(tmp_path / "run.toml")])
    assert r.exit_code == 0, r.output
    said = " ".join(r.output.split())
    assert "its step time costs each document alone" in said and "documents of 600 tokens assumed" in said
    assert tomllib.loads((tmp_path / "run.toml").read_text())["document-mask"] is True
    for words, needle in ((["--document-mask"], "error: --document-mask: give --mean-document-length N"),
                          (["--mean-document-length", "600"], "error: --mean-document-length: only with "
                                                              "--document-mask"),
                          (["--document-mask", "--mean-document-length", "0.5"], "mean_document_length: 0.5")):
        r = runner.invoke(app, [*flags, *words])
        assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, r.output


def test_layout_auto_plans_with_the_document_mask(tmp_path, monkeypatch):
    """`plait train --layout auto --document-mask` searches with the mask: its memory and its documents' lengths
    read from --data, as the dry run predicts the run it picks."""
    from data_util import documents, write_jsonl
    from plait.cli import auto_layout as auto
    from plait.cli.predict import row_lengths
    from plait.data.prepare import prepare
    from plait.train import TrainConfig

    prepare([str(write_jsonl(tmp_path / "d.jsonl", documents(300, max_words=6)))], "bytes", tmp_path / "data",
            workers=1, held_out=0.1)
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "empty-cache"))  # an uncalibrated host: the catalogue's cpu
    from plait.plan.search import SearchResult

    seen = []
    monkeypatch.setattr("plait.plan.search", lambda model, cluster, training, top: seen.append(training) or
                        SearchResult([]))
    cfg = TrainConfig.from_dict({"seq_len": 64, "batch_size": 4, "data": [str(tmp_path / "data")],
                                 "document_mask": True, "nproc": 2})
    with pytest.raises(ConfigError):
        auto.auto_layout(cfg, 2)
    assert seen[0].document_mask and seen[0].documents == row_lengths(cfg)
