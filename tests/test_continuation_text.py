"""A continuation's text keeps the space that parts it from its prompt under a tokenizer whose decoder drops the
leading space of what it decodes (SentencePiece's "▁", as Llama 2, Mistral and Mixtral ship): plait serve's
streamed and whole texts, plait generate's and plait.generate's, all read as prompt and continuation decoded
together."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from data_util import documents
from plait.tokenizers import ByteTokenizer, FileTokenizer, continuation

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory) -> FileTokenizer:
    """A BPE tokenizer.json with a Metaspace pre-tokenizer and decoder (words start with "▁")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator(documents(200), trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    path = Path(tmp_path_factory.mktemp("metaspace")) / "tokenizer.json"
    tok.save(str(path))
    return FileTokenizer(path)


def _word(tok: FileTokenizer, word: str) -> int:
    [i] = tok.encode(word)
    assert tok.token(i) == "▁" + word
    return i


def test_a_continuation_keeps_the_space_before_its_first_word(metaspace):
    prompt, stage = metaspace.encode("the parallel"), _word(metaspace, "stage")
    assert metaspace.decode([stage, stage]) == "stage stage"  # decoded alone, the first space is gone
    assert continuation(metaspace, prompt, [stage, stage]) == " stage stage"
    assert continuation(ByteTokenizer(), list(b"ab"), list(b"cd")) == "cd"


def test_serve_streams_and_returns_the_space_and_echo_reads_as_the_whole(metaspace):
    from plait.generation.decode import Sampling
    from plait.models import Llama, LlamaConfig
    from plait.serve.engine import Engine, Request
    from plait.serve.kv import BlockAllocator
    from plait.serve.metrics import Metrics
    from plait.serve.runner import Runner
    from plait.serve.sampling import Params
    from plait.serve.scheduler import Scheduler

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)).eval()
    engine = Engine(Runner(model, num_blocks=16, block_size=4), Scheduler(BlockAllocator(16, 4), max_batch=2),
                    metaspace, Metrics(), distributed=False)
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    prompt, stage = metaspace.encode("the parallel"), _word(metaspace, "stage")
    events: list[dict] = []
    done = threading.Event()

    def sink(ev: dict) -> None:
        events.append(ev)
        if ev["type"] in ("done", "error"):
            done.set()
    try:
        assert engine.ready.wait(30)
        engine.submit(Request(prompt, Params(Sampling(3), logit_bias={stage: 100.0}), sink))
        assert done.wait(30)
    finally:
        engine.stopping.set()
        thread.join(10)
    text = "".join(ev["text"] for ev in events)
    assert [ev["id"] for ev in events if ev["type"] == "token"] == [stage] * 3
    assert text == " stage stage stage" == continuation(metaspace, prompt, [stage] * 3)
    assert "the parallel" + text == metaspace.decode(prompt + [stage] * 3)


def test_generate_returns_the_space_in_python_and_prints_it(metaspace, tmp_path, capsys, monkeypatch):
    from plait.generation import generate
    from plait.generation.job import generate_job
    from plait.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)).eval()
    out = generate(model, ["the parallel", "replicas"], max_new_tokens=4, tokenizer=metaspace)
    for prompt, text in zip(["the parallel", "replicas"], out, strict=True):
        ids = metaspace.encode(prompt)
        whole = metaspace.decode(ids + generate(model, ids, max_new_tokens=4))
        assert prompt + text == whole
    model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(metaspace.path.read_bytes())
    monkeypatch.setenv("WORLD_SIZE", "1")
    payload = {"tp": 1, "pp": 1, "model": str(tmp_path), "prompts": ["the parallel"], "max_new_tokens": 4,
               "temperature": 0.0, "top_k": 0, "seed": 0}
    assert generate_job(payload) == out[:1]
    assert "the parallel" + out[0] in capsys.readouterr().out


def _logprobs(tok, body: dict, prompt: list[int], ids: list[int]) -> dict:
    """The final choice of a request whose tokens were ``ids`` (each with log-probability -1 and itself as top)."""
    from plait.serve.protocol import Limits, parse
    from plait.serve.responses import Choice
    from plait.serve.tokens import TokenizerInfo

    p = parse({"max_tokens": 8, **body}, "messages" in body, TokenizerInfo(tok, "/nonexistent", 64),
              Limits("m", 64, 512, 16, 64))
    choice = Choice(p, 0, prompt, tok)
    for t in ids:
        choice.feed({"type": "token", "id": t, "text": "", "logprob": (-1.0, [(t, -1.0)])})
    choice.feed({"type": "done", "finish_reason": "length", "text": ""})
    return choice.final()


def test_logprob_tokens_join_into_the_text_and_bytes_are_each_tokens_own(metaspace, tmp_path):
    from data_util import bpe_folder

    prompt, stage = metaspace.encode("the parallel"), _word(metaspace, "stage")
    out = _logprobs(metaspace, {"prompt": "the parallel", "logprobs": 1}, prompt, [stage, stage])["logprobs"]
    assert out["tokens"] == [" stage"] * 2 and out["text_offset"] == [0, 6]
    assert out["top_logprobs"] == [{" stage": -1.0}] * 2
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
    for tok in (ByteTokenizer(), FileTokenizer(bpe_folder(tmp_path / "bpe") / "tokenizer.json")):
        ids = tok.encode("日本語")
        assert any(tok.decode([t]) == "\ufffd" for t in ids)  # a character split over tokens
        entries = _logprobs(tok, chat, tok.encode("x"), ids)["logprobs"]["content"]
        assert b"".join(bytes(e["bytes"]) for e in entries).decode() == "日本語"
        assert [e["bytes"] for e in entries] == [e["top_logprobs"][0]["bytes"] for e in entries]
