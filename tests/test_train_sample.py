"""The sample plait train draws at the end of a run: where it stops (the data's or the model folder's end of
sequence, as plait generate stops), and what prompts it (the opening of a conversation of chat data, else the
first tokens of the data)."""

from __future__ import annotations

import json

import pytest

from plait.train.config import TrainConfig


def test_the_sample_ends_where_plait_generate_ends_the_checkpoints_continuations(tmp_path):
    """A model trained on documents each followed by an EOS learns to write it: the sample stops there, and at
    the end-of-sequence ids its model folder names, as ``plait generate`` of the checkpoint does
    (plait.generation.job.stop_ids), and decoding stops too (it ran every --sample-tokens position, printed the
    folder's EOS and what the model drew after it)."""
    from dataclasses import replace
    from types import SimpleNamespace

    import torch

    from plait.generation import Sampling, generate_ids
    from plait.models import Llama, LlamaConfig
    from plait.tokenizers import ByteTokenizer
    from plait.train.loop import sample_text

    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=1, n_heads=2, max_seq_len=64)).eval()
    calls: list[int] = []
    model.layers[0].register_forward_hook(lambda *_: calls.append(1))
    cfg = TrainConfig.from_dict({"tp": 1, "pp": 1, "dp": 1, "sample_tokens": 12, "seed": 3})
    tok = ByteTokenizer()
    ids = generate_ids(model, [tok.encode("def ")], Sampling(12, temperature=0.8, top_k=20, seed=3))[0]
    run = SimpleNamespace(cfg=cfg, pm=model, tokenizer=tok, data=SimpleNamespace(eos=None))
    calls.clear()
    said: list[str] = []
    assert sample_text(run, said.append) == "def " + tok.decode(ids) and len(calls) == 12  # no EOS: every token
    assert said == ["sampling up to 12 tokens ..."]  # told once, before the decoding
    ended = "\n[the sample ends: end-of-sequence token]"
    run.data.eos = ids[6]
    cut = ids.index(ids[6])
    calls.clear()
    assert sample_text(run, said.append) == "def " + tok.decode(ids[:cut]) + ended
    assert len(calls) == cut + 1 < 12, calls  # the prefill and a step per token up to the EOS: no more
    folder = tmp_path / "m"  # trained from a model folder that names an EOS (an HF model's generation_config)
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [999, ids[3]]}))
    run.cfg = replace(cfg, model=str(folder))
    first = min(ids.index(ids[3]), cut)
    calls.clear()
    assert sample_text(run, said.append) == "def " + tok.decode(ids[:first]) + ended
    assert len(calls) == first + 1, calls


def test_the_sample_of_chat_data_is_the_reply_to_a_conversation_of_the_data(tmp_path):
    """The sample at the end was prompted by "def " whatever the data: chat data gets the opening of one of its
    conversations up to the assistant's header (the sample is the reply), text its first tokens."""
    from types import SimpleNamespace

    import torch

    from plait.data import prepare
    from plait.data.chat import ChatSpec
    from plait.data.stream import PROMPT_TOKENS, open_data
    from plait.models import Llama, LlamaConfig
    from plait.tokenizers import ByteTokenizer
    from plait.train.loop import sample_text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "4."}]
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": messages}) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}) + "\n")
    prepare([str(tmp_path / "chats.jsonl")], "bytes", tmp_path / "d", workers=1, held_out=0.0, chat=ChatSpec("bytes"))
    (tmp_path / "a.txt").write_text("Once upon a time there was a tokenizer. " * 10)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=256, dim=32, n_layers=1, n_heads=2, max_seq_len=128)).eval()
    for data, want in (([str(tmp_path / "d")], "<|system|>\nBe brief.\n<|user|>\nWhat is 2+2?\n<|assistant|>\n"),
                       ([str(tmp_path / "a.txt")], "Once upon a time"[:PROMPT_TOKENS])):
        cfg = TrainConfig.from_dict({"tp": 1, "pp": 1, "dp": 1, "sample_tokens": 12, "data": data})
        run = SimpleNamespace(cfg=cfg, pm=model, tokenizer=ByteTokenizer(),
                              data=open_data(data, "tiny", 256, 32, 2, 0, 1))  # a conversation over seq_len
        assert bytes(run.data.prompt(64)).decode() == want  # sample_text's: half the model's context
        sample = sample_text(run, lambda _: None)
        assert sample.startswith(want) and len(sample.encode()) > len(want), sample


def test_the_sample_prompt_of_a_template_ending_each_turn_with_the_eos_is_the_whole_opening(tmp_path):
    """ChatML's <|im_end|> ends every turn and is the dataset's end-of-document token: the prompt was the first
    8 tokens ("<|im_start|>system\\n", cut at the system turn's end), now the conversation up to the assistant."""
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer

    from chat_templates import QWEN25, template_folder
    from plait.data import prepare
    from plait.data.chat import ChatSpec
    from plait.data.stream import open_data

    chat = [{"role": "user", "content": "what is 2 plus 2?"}, {"role": "assistant", "content": "2 plus 2 is 4."}]
    folder = str(template_folder(tmp_path / "qwen", "jinja", QWEN25, None, "<|im_end|>", "what is 2 plus 4 " * 8))
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    prepare([str(tmp_path / "chats.jsonl")], folder, tmp_path / "d", workers=1, held_out=0.0, chat=ChatSpec(folder))
    hf = AutoTokenizer.from_pretrained(folder)
    want = list(hf.apply_chat_template(chat[:1], add_generation_prompt=True, tokenize=True, return_dict=False))
    assert want.count(hf.convert_tokens_to_ids("<|im_end|>")) == 2  # the default system turn's and the user's
    data = open_data([str(tmp_path / "d")], folder, 512, 32, 2, 0, 1)
    assert data.prompt(256) == want
