"""The planner counts document masking's memory (plait.plan.documents): what it predicts for a run with
--document-mask is what the run's meter measures, on the path the planner counts (the mask, or each document
alone), and the prediction's memory line says which."""

from __future__ import annotations

import pytest
import torch

import checks_documents as cd
import plait
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
    memory note says which attention path they count."""
    import json

    from typer.testing import CliRunner

    from plait.cli.main import app
    from profile_util import synthetic_profile

    path = synthetic_profile(counts=(1,), block=True).save(tmp_path / "host.toml")
    flags = ["--model", "tiny", "--seq-len", "128", "--batch-size", "4", "--tp", "1", "--pp", "1", "--dp", "1",
             "--dry-run", "--cluster", str(path)]
    peaks = {}
    for mask in (False, True):
        metrics = tmp_path / f"{mask}.jsonl"
        r = CliRunner().invoke(app, ["train", *flags, "--metrics", str(metrics), *(["--document-mask"] * mask)])
        assert r.exit_code == 0, r.output
        row = json.loads(metrics.read_text())
        peaks[mask] = row["memory"]["predicted"][0]["activations_peak"]
        assert any("--document-mask" in n for n in row["memory"]["notes"]) == mask
    assert "each document alone" in " ".join(r.output.split())
    # 4 micro-batches of 1 x 128, one in flight: per-row tables (none beyond the shared pair at b = 1) and one
    # q-sized [1, 128, 128] fp32 tensor in each of tiny's 4 layers
    assert peaks[True] - peaks[False] == pytest.approx(4 * 128 * 128 * 4)
