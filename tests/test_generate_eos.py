"""plait generate ends each continuation at the model folder's end-of-sequence token, as transformers' generate."""

from __future__ import annotations

import json

import pytest
import torch

import checks_generate as cg
from checks_generate import CASES, LAYOUTS, NEW, PROMPTS, stops_of
from data_util import EOS, bpe_folder
from harness import result
from plait.generation import generate
from plait.generation.job import generate_job
from plait.models import Llama, LlamaConfig
from plait.tokenizers import ByteTokenizer, eos_ids


def test_plait_generate_stops_at_the_folders_end_of_sequence_token(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=1, n_heads=2, max_seq_len=64)).eval()
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    ids = generate(model, [list(b"def ")], max_new_tokens=12)[0]
    payload = {"model": str(folder), "prompts": ["def "], "tp": 1, "pp": 1, "max_new_tokens": 12,
               "temperature": 0.0, "top_k": 0, "seed": 0}
    tok = ByteTokenizer()
    assert eos_ids(folder) == () and generate_job(payload) == [tok.decode(ids)]  # no EOS named: every token
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": [999, ids[5]]}))
    assert eos_ids(folder) == (999, ids[5])
    assert generate_job(payload) == [tok.decode(ids[:ids.index(ids[5])])]  # was: on past the EOS, 12 tokens
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids[2]}))  # it wins over config
    assert generate_job(payload) == [tok.decode(ids[:ids.index(ids[2])])]
    capsys.readouterr()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids[0]}))  # its first token
    assert generate_job(payload) == [""]
    assert capsys.readouterr().err == ("plait generate: --prompt 'def ': nothing generated: the model's first token "
                                       f"was its end-of-sequence token (id {ids[0]})\n")  # was a blank line alone


def test_plait_generate_stop_cuts_each_continuation_before_its_first_stop_string(tmp_path, monkeypatch, capsys):
    """plait generate had no --stop (plait serve's API takes stop strings): each continuation now ends at the first
    --stop text it holds, cut before it; an empty --stop is refused before anything launches."""
    from typer.testing import CliRunner

    from plait.cli.main import app

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.manual_seed(0)
    Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=1, n_heads=2, max_seq_len=64)).save_pretrained(tmp_path / "m")
    payload = {"model": str(tmp_path / "m"), "prompts": ["def ", "class "], "tp": 1, "pp": 1, "max_new_tokens": 24,
               "temperature": 0.0, "top_k": 0, "seed": 0}
    full = generate_job(payload)
    stops = [next(c for c in text[3:] if c != "\ufffd") for text in full]  # a character each text holds
    cut = generate_job({**payload, "stop": stops})
    assert cut == [min((t[: t.index(s)] for s in stops if s in t), key=len) for t in full]  # was: no --stop at all
    assert all(len(c) < len(t) for c, t in zip(cut, full, strict=True))
    capsys.readouterr()
    assert generate_job({**payload, "prompts": ["def "], "stop": [full[0][0]]}) == [""]
    assert capsys.readouterr().err == ("plait generate: --prompt 'def ': nothing generated: the continuation began "
                                       "with a --stop string\n")
    res = CliRunner().invoke(app, ["generate", "--model", str(tmp_path / "m"), "--stop", ""])
    assert res.exit_code == 2 and res.output.startswith("error: --stop '': an empty string would end every "), \
        res.output


def test_a_plait_checkpoint_ends_where_its_training_data_ended_each_document(tmp_path):
    """A byte-level model has no folder to name its EOS: the checkpoint's record of its data's end-of-document
    token says where generate and serve stop (a chat model trained by plait wrote NULs to the end of max_tokens)."""
    from plait.checkpoint.store import FORMAT, META
    from plait.generation.job import end_ids

    step = tmp_path / "ck" / "step_00000004"
    step.mkdir(parents=True)
    meta = {"format": FORMAT, "step": 4, "tokenizer": {"folder": None, "fingerprint": "bytes", "eos": 0}}
    (step / META).write_text(json.dumps(meta))
    assert end_ids(str(tmp_path / "ck")) == end_ids(str(step)) == (0,)
    (step / META).write_text(json.dumps({**meta, "tokenizer": {"folder": None, "fingerprint": "bytes"}}))
    assert end_ids(str(step)) == ()  # saved before checkpoints kept it: nothing known


def _cut(rows: list[list[int]], stop: set[int]) -> list[list[int]]:
    return [r[: next((i for i, t in enumerate(r) if t in stop), len(r))] for r in rows]


def _last_position(rows: list[list[int]], which: list[int] | None = None) -> int:
    """The last decode position rows ``which`` (of continuations ``rows`` of PROMPTS) need: position p writes
    column min(len(prompt)) + p; a row cut short needs its stop token's column, the others their last one."""
    which = list(range(len(PROMPTS))) if which is None else which
    return max(len(PROMPTS[i]) + min(len(rows[i]), NEW - 1) for i in which) - min(len(p) for p in PROMPTS)


def test_decoding_stops_once_every_continuation_has_ended():
    """The decode loop itself stops: fewer forward passes than max_new_tokens, the tokens of the full run cut
    before each row's first stop token (the old loop ran all NEW positions, then cut)."""
    from plait.generation.decode import Sampling, generate_ids

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=2, max_seq_len=64)).eval()
    calls: list[int] = []
    model.layers[0].register_forward_hook(lambda *_: calls.append(1))
    for temperature, top_k, seed in ((0.0, 0, 0), (0.9, 8, 5)):
        s = Sampling(NEW, temperature, top_k, seed)
        full = generate_ids(model, PROMPTS, s)
        assert all(len(r) == NEW for r in full)
        stop = stops_of(full)
        calls.clear()
        out = generate_ids(model, PROMPTS, s, stop_ids=stop)
        assert out == _cut(full, stop) and all(len(r) < NEW for r in out)
        assert len(calls) == _last_position(out) + 1 < NEW, (temperature, len(calls))
        assert generate(model, PROMPTS, NEW, temperature, top_k, seed, stop_ids=stop) == out
    assert generate_ids(model, PROMPTS, Sampling(NEW), stop_ids={999}) == generate_ids(model, PROMPTS, Sampling(NEW))


def test_stop_strings_end_each_continuation_and_the_decoding():
    """A continuation ends with the token whose text completes a stop string (an id list keeps that token, a text
    is cut before the string), and the decode loop stops once every row has ended, as with stop ids."""
    from plait.generation.decode import Sampling, generate_ids

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=2, n_heads=2, max_seq_len=64)).eval()
    calls: list[int] = []
    model.layers[0].register_forward_hook(lambda *_: calls.append(1))
    tok = cg.CharTokenizer()
    for temperature, top_k, seed in ((0.0, 0, 0), (0.9, 8, 5)):
        s = Sampling(NEW, temperature, top_k, seed)
        full = generate_ids(model, PROMPTS, s)
        stops = cg.stop_texts_of(full)
        calls.clear()
        out = generate_ids(model, PROMPTS, s, texts=cg.trackers(stops))
        assert out == cg.cut_after_stop_text(full, stops) and all(len(r) < NEW for r in out)
        assert len(calls) == _last_position([r[:-1] for r in out]) + 1 < NEW, (temperature, len(calls))  # each row
        texts = [tok.decode(p) for p in PROMPTS]  # ends at its last token's column (a stop id's is past its end)
        got = generate(model, texts, NEW, temperature, top_k, seed, tokenizer=tok, stop=stops)
        assert got == [tok.decode(r[:-2]) for r in out]  # each text cut before the two-token string that ended it
    unmatched = generate(model, texts, NEW, tokenizer=tok, stop=["not there"])
    assert unmatched == [tok.decode(r) for r in generate_ids(model, PROMPTS, Sampling(NEW))]


def test_every_rank_of_a_replica_must_decode_with_the_same_stop_strings(monkeypatch):
    """A rank given other stop strings would end a row that its peers go on with, and wait for what they skip: the
    stop strings are part of the settings every rank of a replica is checked to share before decoding."""
    import plait
    from plait.generation import decode
    from plait.generation.text import TextTracker

    seen: list[list[float]] = []
    monkeypatch.setattr(decode, "check_same_batch", lambda ctx, ids, settings, words: seen.append(settings.tolist()))
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=1, n_heads=2, max_seq_len=64))
    with plait.init(tp=1, pp=1, dp=1) as ctx:
        pm = plait.parallelize(model, ctx, microbatches=1)
        for stops in (["ab"], ["ac"], ["ab"], []):
            decode.generate_ids(pm, PROMPTS, decode.Sampling(2), texts=[TextTracker(ByteTokenizer(), stops)
                                                                         for _ in PROMPTS])
    assert seen[0] == seen[2] and seen[0] != seen[1] and seen[0] != seen[3]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_stops_together_under_each_layout(world4, layout):
    """Under every layout of a world of 4 (checks_generate.LAYOUTS: pp 2 and 4, interleaved and V-shaped chunk
    placements, tp and dp replicas, ZeRO-3) every rank returns one device's tokens cut at the stop ids and ran exactly
    the items of the positions its row groups needed, fewer than max_new_tokens: greedy groups stop on their
    own (at different positions here), sampled ones together. A rank that skipped an item another waits for
    makes that rank's receive or the final broadcast fail after checks_generate.WAIT_S, naming it."""
    refs, ranks = result(world4, "generate/reference"), result(world4, f"generate/{layout}")
    full, stops = refs[0]["full"], refs[0]["stops"]
    assert all(ref == refs[0] for ref in refs)
    for case in CASES:
        expected = _cut(full[case], set(stops[case]))
        assert all(len(r) < NEW for r in expected), case
        for rank, res in enumerate(ranks):
            got = res[case]
            assert got["ids"] == expected, (rank, case)
            groups = [t.tolist() for t in torch.arange(len(PROMPTS)).tensor_split(min(got["pp"], len(PROMPTS)))]
            last = [_last_position(expected, rows if case == "greedy" else None) for rows in groups]
            if case == "greedy" and len(groups) > 1:
                assert len(set(last)) > 1, last  # the groups stop at different positions: each skips on its own
            items = [(c, g, p) for c in got["chunks"] for g in range(len(groups)) for p in range(last[g] + 1)]
            assert sorted(map(tuple, got["items"])) == sorted(items), (rank, case, last)
            assert max(last) + 1 < NEW
            cut = cg.cut_after_stop_text(full[case], refs[0]["stop_texts"][case])  # stop strings instead of ids
            assert got["text_ids"] == cut and all(len(r) < NEW for r in cut), (rank, case)
            last = [_last_position([r[:-1] for r in cut], rows if case == "greedy" else None) for rows in groups]
            items = [(c, g, p) for c in got["chunks"] for g in range(len(groups)) for p in range(last[g] + 1)]
            assert sorted(map(tuple, got["text_items"])) == sorted(items), (rank, case, last)


@pytest.mark.parametrize("text", [b"{", b'{"eos_token_id": "\xff"}', b"[0]"], ids=["not-json", "not-utf8", "a-list"])
def test_a_folders_json_files_that_say_nothing_readable_name_nothing_in_every_reader(tmp_path, text):
    """config.json, generation_config.json, tokenizer_config.json and special_tokens_map.json that are not JSON,
    not UTF-8 or not an object: the folder names no end ids, no special tokens and no chat template, and a data
    prepare falls back to the tokenizer's own end-of-text token, as for a folder without those files."""
    from plait.chat_template import folder_templates, special_tokens
    from plait.data.tokens import TokenizerSpec

    folder = bpe_folder(tmp_path / "tok")
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).write_bytes(text)
    assert eos_ids(folder) == () and special_tokens(folder) == {} and folder_templates(folder) == ({}, "")
    tok = TokenizerSpec(str(folder)).load()
    assert tok.eos(None) == tok.tok.token_to_id(EOS)
