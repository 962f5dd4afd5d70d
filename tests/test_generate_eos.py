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
