"""plait generate ends each continuation at the model folder's end-of-sequence token, as transformers' generate."""

from __future__ import annotations

import json

import torch

from plait.generation import generate
from plait.generation.job import generate_job
from plait.models import Llama, LlamaConfig
from plait.tokenizers import ByteTokenizer, eos_ids


def test_plait_generate_stops_at_the_folders_end_of_sequence_token(tmp_path, monkeypatch):
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


PROMPTS = [[100, 101, 102], [7, 8, 9, 10, 11, 12], [40, 41], [65, 66, 67, 68]]
NEW = 16


def _cut(rows: list[list[int]], stop: set[int]) -> list[list[int]]:
    return [r[: next((i for i, t in enumerate(r) if t in stop), len(r))] for r in rows]


def _last_position(rows: list[list[int]], which: list[int] | None = None) -> int:
    """The last decode position rows ``which`` (of continuations ``rows`` of PROMPTS) need: position p writes
    column min(len(prompt)) + p; a row cut short needs its stop token's column, the others their last one."""
    which = list(range(len(PROMPTS))) if which is None else which
    return max(len(PROMPTS[i]) + min(len(rows[i]), NEW - 1) for i in which) - min(len(p) for p in PROMPTS)


def _stops_of(full: list[list[int]]) -> set[int]:
    """Stop ids that end each row well before NEW tokens (at the latest at the token picked from it), the last
    row (group 1 under pp 2) last."""
    return {full[i][k] for i, k in enumerate((4, 3, 1, 8))}


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
        stop = _stops_of(full)
        calls.clear()
        out = generate_ids(model, PROMPTS, s, stop_ids=stop)
        assert out == _cut(full, stop) and all(len(r) < NEW for r in out)
        assert len(calls) == _last_position(out) + 1 < NEW, (temperature, len(calls))
        assert generate(model, PROMPTS, NEW, temperature, top_k, seed, stop_ids=stop) == out
    assert generate_ids(model, PROMPTS, Sampling(NEW), stop_ids={999}) == generate_ids(model, PROMPTS, Sampling(NEW))


def _parallel_rank(model_dir: str, stops: dict) -> dict:
    import plait
    from plait.generation.decode import Sampling, generate_ids
    from plait.generation.job import load_model

    out = {}
    for tp, pp in ((1, 2), (2, 1)):
        with plait.init(tp, pp, 1) as ctx:
            model = load_model(model_dir, ctx=ctx)[0]
            for case, (temperature, top_k, seed) in CASES.items():
                trace: list = []
                ids = generate_ids(model, PROMPTS, Sampling(NEW, temperature, top_k, seed), trace=trace,
                                   stop_ids=stops[case])
                out[f"{tp}x{pp}/{case}"] = (ids, [(c, g, p) for c, g, p, _t0, _t1 in trace])
    return out


CASES = {"greedy": (0.0, 0, 0), "sampled": (0.9, 8, 5)}


def test_every_rank_stops_together_under_tp_and_pp(tmp_path):
    """Under pp 2 (two row groups: greedy groups stop on their own, sampled ones together) and tp 2, every rank
    runs the same positions, fewer than max_new_tokens, and returns one device's tokens cut at the stop ids."""
    from harness import PRELOAD
    from plait.distributed.launch import run_world
    from plait.generation.decode import Sampling, generate_ids
    from plait.generation.job import load_model
    from serve_util import tiny_model

    model_dir = tiny_model(tmp_path / "tiny")
    ref = load_model(str(model_dir))[0]
    full = {case: generate_ids(ref, PROMPTS, Sampling(NEW, *args)) for case, args in CASES.items()}
    stops = {case: _stops_of(rows) for case, rows in full.items()}
    ranks = run_world(_parallel_rank, 2, str(model_dir), stops, timeout_s=200, preload=PRELOAD)
    for case in CASES:
        expected = _cut(full[case], stops[case])
        assert all(len(r) < NEW for r in expected)
        groups = [[0, 1], [2, 3]] if case == "greedy" else [[0, 1, 2, 3]] * 2  # sampled: one stop unit
        last = [_last_position(expected, g) for g in groups]
        assert last[0] != last[1] or case == "sampled"  # the greedy groups stop at different positions
        for rank, res in enumerate(ranks):
            ids, items = res[f"1x2/{case}"]
            assert ids == expected, (rank, case)
            for g in (0, 1):
                assert sorted({p for _c, h, p in items if h == g}) == list(range(last[g] + 1)), (rank, case, g)
            ids, items = res[f"2x1/{case}"]
            assert ids == expected, (rank, case)
            assert sorted({p for *_, p in items}) == list(range(_last_position(expected) + 1)), (rank, case)
            assert _last_position(expected) + 1 < NEW
