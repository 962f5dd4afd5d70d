"""Document masking of packed samples (plait.documents): each document's loss, gradients and logits equal that
document run alone, on one device and under every layout (TP+SP, PP schedules, DP, EP, CP all-gather and ring,
recomputation, ZeRO-3, bf16); documents and positions from the EOS; the unmasked fast path; bad settings."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

import checks_documents as cd
import plait
from harness import result
from plait import documents as documents_module
from plait.documents import DocumentCore, Documents, document_ids
from plait.models import Llama

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # parallel equals single device within float32 rounding
BF16_LOSS_TOL, BF16_GRAD_TOL, BF16_LOGITS_TOL = 1e-4, 5e-2, 2e-2  # as tests/test_context.py's bf16 checks


def within(r: dict, what: str, loss_tol: float = LOSS_TOL, grad_tol: float = GRAD_TOL,
           logits_tol: float = LOSS_TOL) -> None:
    assert r["loss_rel"] <= loss_tol, f"{what}: loss rel err {r['loss_rel']:.2e}"
    assert r["grad_rel_max"] <= grad_tol, f"{what}: {r['worst_grad']} rel err {r['grad_rel_max']:.2e}"
    assert r["logits_rel"] <= logits_tol, f"{what}: eval logits rel err {r['logits_rel']:.2e}"


def test_document_ids_and_positions_restart_after_each_eos():
    tokens = torch.tensor([[5, 0, 7, 8, 0, 0, 9], [0, 3, 4, 5, 6, 7, 0]])
    ids, pos = document_ids(tokens, eos=0)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]  # an EOS ends its own document
    assert pos.tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]


@pytest.fixture(params=["split", "mask"])
def path(request, monkeypatch):
    """Each document's attention alone (the default for few documents), or one mask for the micro-batch."""
    if request.param == "mask":
        monkeypatch.setattr(documents_module, "SPLIT_MAX", 0)
    return request.param


@pytest.mark.parametrize("layout", [dict(), dict(microbatches=2), dict(microbatches=4, recompute="selective"),
                                    dict(microbatches=2, recompute="full")], ids=["m1", "m2", "selective", "full"])
def test_one_device_equals_each_document_alone(layout, path):
    r = cd.compare(None, **layout)
    within(r, str(layout))
    assert r["targets"] == 64 - 1 - 5  # 4 rows of 16, less the ignored target and the 5 after an EOS


def test_one_device_with_window_biases_and_qk_norm_equals_each_document_alone(path):
    within(cd.compare(cd.FEATURES, microbatches=2), "features")


def test_without_the_mask_documents_see_each_other():
    """The reference tells masking from none: without it the packed rows differ from the documents alone."""
    r = cd.compare(None, None, microbatches=2)
    assert r["logits_rel"] > 0.1 and r["grad_rel_max"] > 0.1 and r["targets"] == 64 - 1


def test_one_document_per_row_keeps_unmasked_attention():
    """A micro-batch with no EOS before its rows' last token runs the module's own core with no mask (SDPA's
    is_causal); one with several documents gets the additive mask, one tensor for all layers (past split_max
    documents), or each document alone with no mask."""
    calls = []

    def core(q, k, v, mask, causal=True):
        calls.append(mask)
        return q

    docs = Documents(eos=0, microbatches=2, split_max=2)
    shadow = DocumentCore(core, docs)
    inputs = torch.tensor([[4, 5, 6, 0], [7, 8, 0, 9], [1, 2, 3, 0], [4, 5, 6, 7]])
    use = docs.start(inputs)
    assert use is not None
    q = torch.zeros(2, 1, 4, 2)
    use(1)  # rows 2 and 3: an EOS only as a last token
    shadow(q, q, q, None)
    use(0)
    shadow(q, q, q, None)
    shadow(q, q, q, None)
    assert calls[0] is None and docs.ids is not None
    assert calls[1] is calls[2] and calls[1].shape == (2, 1, 4, 4)
    seen = calls[1][1, 0] == 0  # row 1: documents [7, 8, 0] and [9]
    assert seen.tolist() == [[True, False, False, False], [True, True, False, False], [True, True, True, False],
                             [False, False, False, True]]
    assert Documents(None).start(inputs) is None  # no masking: the executor is handed no hook
    calls.clear()
    split = Documents(eos=0, microbatches=2)  # 3 documents: each alone
    split.start(inputs)(0)
    out = DocumentCore(lambda q, k, v, mask, causal=True: calls.append((q.shape, mask)) or q, split)(q, q, q, None)
    assert calls == [((1, 1, 4, 2), None), ((1, 1, 3, 2), None), ((1, 1, 1, 2), None)] and out.shape == q.shape


def test_each_document_alone_writes_no_more_in_backward_for_more_documents():
    """The backward of each document's attention alone writes about the gradients of q, k and v once, however many
    documents a row holds (cut per document by slicing, each document's gradient came back as a zero-filled
    tensor of the whole q, k or v, summed with the others: 16 documents wrote 6.7 times what 2 did)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Written(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.elements += sum(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    def backward_elements(documents: int) -> int:
        s = 256
        inputs = torch.ones(2, s, dtype=torch.long)
        inputs[:, s // documents - 1:s - 1:s // documents] = 0  # documents of s/documents tokens, EOS last
        docs = Documents(eos=0)
        docs.start(inputs)(0)
        q, k, v = (torch.randn(2, 2, s, 8, requires_grad=True) for _ in range(3))
        core = DocumentCore(lambda q, k, v, mask, causal=True: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal), docs)
        out = core(q, k, v, None)
        assert docs.spans is not None and len(docs.spans[0]) == documents  # each document alone
        with Written() as written:
            out.sum().backward()
        return written.elements

    assert backward_elements(16) < 1.5 * backward_elements(2)


def test_positions_restart_at_each_document():
    """The rotary tables a masked module uses are those of each token's position within its document, per row."""
    from plait.documents import apply_documents

    model = Llama(cd.model_config())
    docs = Documents(eos=0)
    modules = {f"layers.{i}.self_attn": layer.self_attn for i, layer in enumerate(model.layers)}
    assert apply_documents(modules, docs, cp=1) == 4
    attn = model.layers[1].self_attn
    inputs = torch.tensor([[4, 5, 0, 9, 9], [0, 3, 0, 0, 1]])
    use = docs.start(inputs)
    assert use is not None
    use(0)
    cos, sin = attn.rope(5, 0, torch.float32)
    want_cos, want_sin = attn.rotary.build_at(torch.tensor([[0, 1, 2, 0, 1], [0, 0, 1, 0, 0]]), torch.float32,
                                              torch.device("cpu"))
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    use(None)  # after a step: the module's own tables again
    assert attn.rope(5, 0, torch.float32)[0].shape == (5, cd.model_config().head_dim)


def test_the_mask_adds_the_bytes_docs_data_md_states():
    """What autograd keeps with document masking beyond an unmasked step (the planner's and --dry-run's count):
    RoPE tables per row [b, 1, S, hd] (cos and sin) where an unmasked step keeps one [S, hd] pair; and the
    additive mask [b, 1, S, S] once for all layers (past split_max documents), or one q-sized tensor per layer
    (each document alone). One micro-batch in flight, every row holding several documents."""
    cfg = cd.model_config(max_seq_len=32)
    tokens = torch.randint(1, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(3))
    tokens[:, 10] = cd.EOS
    peak = {}
    with plait.init(1, 1, 1) as ctx:
        for eos, split_max in ((None, 0), (cd.EOS, 0), (cd.EOS, 64)):
            torch.manual_seed(0)
            pm = plait.parallelize(Llama(cfg), ctx, microbatches=2, document_eos=eos)
            pm.documents.split_max = split_max
            pm.train_step(tokens[:, :-1], tokens[:, 1:], measure_memory=True)
            peak[eos, split_max] = pm.activations_peak
    b, s, hd = 2, 32, cfg.head_dim  # rows of a micro-batch
    tables = 2 * (b - 1) * s * hd
    assert peak[cd.EOS, 0] - peak[None, 0] == (b * s * s + tables) * 4  # the mask
    # each document alone: no mask, one q-sized tensor [b, S, heads·hd] more per layer (linear in S)
    assert peak[cd.EOS, 64] - peak[None, 0] == (tables + cfg.n_layers * b * s * cfg.n_heads * hd) * 4


def test_without_document_eos_the_attention_modules_are_untouched():
    with plait.init(1, 1, 1) as ctx:
        model = Llama(cd.model_config())
        plait.parallelize(model, ctx)
        attn = model.layers[0].self_attn
        assert "core" not in vars(attn) and "rope" not in vars(attn)


@pytest.mark.parametrize("eos,loss_fn,says", [(61, None, "[0, 61)"), (-1, None, "[0, 61)"), (True, None, "integer"),
                                              (0, torch.nn.functional.mse_loss, "next-token loss")])
def test_bad_document_eos_is_a_config_error(eos, loss_fn, says):
    with plait.init(1, 1, 1) as ctx, pytest.raises(plait.ConfigError, match="document_eos") as err:
        plait.parallelize(Llama(cd.model_config()), ctx, loss_fn=loss_fn, document_eos=eos)
    assert says in str(err.value)


def test_plait_train_document_mask_step_loss_is_each_document_alone(tmp_path):
    """plait train --document-mask on prepared byte data (EOS 0 after each short document): the first step's loss
    is that of batch 0's documents run alone through the preset's seeded weights; without the flag it is not."""
    from data_util import documents, write_jsonl
    from plait.data.prepare import prepare
    from plait.data.stream import open_data
    from plait.models import init_weights
    from plait.train import TrainConfig
    from plait.train.config import model_config
    from plait.train.loop import train
    from plait.train.report import Reporter

    prepare([str(write_jsonl(tmp_path / "d.jsonl", documents(60, max_words=6)))], "bytes", tmp_path / "data",
            workers=1, held_out=0.2)
    losses = {}
    for mask in (True, False):
        cfg = TrainConfig.from_dict(dict(model="tiny", data=[str(tmp_path / "data")], document_mask=mask, tp=1, pp=1,
                                         dp=1, microbatches=2, seq_len=64, batch_size=4, steps=1, eval_every=0,
                                         sample_tokens=0, trace_every=0, cluster="none",
                                         checkpoint_dir=str(tmp_path / f"ck{mask}")))
        log = io.StringIO()
        res = train(cfg, reporter=Reporter(cfg, 0, Console(file=log, width=300)))
        losses[mask] = res.losses[1]
        assert res.held_out is not None
        assert ("held out); attention within documents (EOS 0) | batch 4 x 64" in log.getvalue()) is mask
    data = open_data(cfg.data, cfg.model, model_config(cfg).vocab_size, cfg.seq_len, cfg.batch_size, cfg.seed,
                     cfg.max_data_mb)
    x, y = data.batch(0)
    assert data.eos == 0 and int((x[:, :-1] == 0).sum(1).min()) >= 2  # every row packs three documents or more
    ref = cd.alone(model_config(cfg), x, y, eos=0, model=init_weights(Llama(model_config(cfg)), cfg.seed))[0]
    assert abs(losses[True] - ref) / ref <= LOSS_TOL, (losses, ref)
    assert abs(losses[False] - ref) / ref > 1e-3


def test_document_mask_refuses_data_without_one_clean_end_of_document_token(tmp_path):
    """Two sources ending documents with different tokens, and a source whose EOS also occurs inside its documents
    (as a chat template ending each turn with it), are ConfigErrors naming --document-mask."""
    from data_util import documents, write_jsonl
    from plait.data.prepare import prepare
    from plait.data.stream import open_data

    src = str(write_jsonl(tmp_path / "d.jsonl", documents(40, max_words=6)))
    for name, eos in (("nul", None), ("one", "1"), ("space", "32")):
        prepare([src], "bytes", tmp_path / name, workers=1, held_out=0.0, eos=eos)

    def data(*names: str):
        return open_data([f"0.5:{tmp_path / n}" for n in names], "tiny", 256, 32, 4, 0, 1.0)

    assert data("nul").document_eos(True) == 0 and data("nul").document_eos(False) is None
    assert data("one").document_eos(True) == 1
    with pytest.raises(plait.ConfigError, match="--document-mask: .*no one end-of-document token"):
        data("nul", "one").document_eos(True)
    with pytest.raises(plait.ConfigError, match="--document-mask: .*end-of-document token 32 inside them"):
        data("space").document_eos(True)
    # before launch too, so that plait train --dry-run refuses what the run would (it printed a prediction)
    from plait.train.config import TrainConfig, validate

    for names, refused in ((["nul", "one"], "no one end-of-document token"), (["space"], "32 inside them")):
        cfg = TrainConfig.from_dict(dict(tp=1, pp=1, dp=1, microbatches=1, seq_len=32, batch_size=4,
                                         document_mask=True, data=[f"0.5:{tmp_path / n}" for n in names]))
        with pytest.raises(plait.ConfigError, match=f"--document-mask: .*{refused}"):
            validate(cfg, 1)
    validate(TrainConfig.from_dict(dict(tp=1, pp=1, dp=1, microbatches=1, seq_len=32, batch_size=4,
                                        document_mask=True, data=[str(tmp_path / "one")])), 1)


# world4: tests/conftest.py (one launch of 4 ranks shared with the other world-4 modules runs checks_documents)

@pytest.mark.parametrize("case", sorted(cd.CASES))
def test_every_layout_equals_each_document_alone(world4, case):
    for rank, r in enumerate(result(world4, f"equal/{case}")):
        assert r["n_grads"] >= 39
        within(r, f"rank {rank} {case}")


@pytest.mark.parametrize("comm", ["allgather", "ring"])
def test_bf16_within_tolerance(world4, comm):
    for rank, r in enumerate(result(world4, f"bf16/{comm}")):
        within(r, f"rank {rank} bf16/{comm}", BF16_LOSS_TOL, BF16_GRAD_TOL, BF16_LOGITS_TOL)


def test_context_parallel_without_the_mask_differs(world4):
    """The first DP replica's rows hold several documents (the second's one each, the same either way)."""
    assert max(r["logits_rel"] for r in result(world4, "unmasked/cp2dp2")) > 0.1


@pytest.mark.parametrize("case", ["zero1/cp2dp2/ring", "zero2/tp2dp2"])
def test_zero_optimizer_steps_equal_each_document_alone(world4, case):
    for rank, r in enumerate(result(world4, case)):
        assert r["param_rel_max"] <= GRAD_TOL, f"rank {rank} {case}: params after 3 steps {r['param_rel_max']:.2e}"


def test_an_attention_module_without_the_methods_to_shadow_is_refused_naming_it_and_the_method():
    """Document masking and context parallelism shadow an attention module's core, rope and rope_at
    (plait.models.family.attention_methods): one it lacks is a ConfigError naming the module and the method."""
    from torch import nn

    from plait.documents import Documents, apply_documents
    from plait.errors import ConfigError
    from plait.models.family import attention_methods

    class NoRopeAt(nn.Module):
        def core(self): ...

        def rope(self): ...

    with pytest.raises(ConfigError, match=r"^document_eos: attention module layers\.0\.attn has no rope_at\(\) "):
        apply_documents({"layers.0.attn": NoRopeAt()}, Documents(0), 1)
    with pytest.raises(ConfigError, match=r"^a lacks core$"):
        attention_methods("a", nn.Module(), "{name} lacks {method}")
