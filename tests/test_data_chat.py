"""plait data prepare --chat: records' messages rendered with the folder's chat template exactly as transformers'
apply_chat_template, the loss mask on the assistant's tokens (by prefixes; by {% generation %} marks, equal to
transformers' assistant_masks; a document per assistant message for Qwen3's template), bad records by file and line,
and the masked targets and loss training sees (the parallel layouts: tests/test_data_layouts.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from chat_templates import LLAMA3, MISTRAL, QWEN3, QWEN3_CHATS, QWEN3_MARKED, QWEN3_TOOLS, QWEN25, template_folder
from plait.chat_template import PLAIT_SOURCE
from plait.cli.main import app
from plait.data import open_prepared, prepare
from plait.data.chat import ChatSpec
from plait.data.format import META
from plait.data.stream import IGNORE, open_data
from plait.errors import ConfigError

pytest.importorskip("transformers")

CHATS = [[{"role": "user", "content": "hello world, what is the weather?"},
          {"role": "assistant", "content": "  the weather is hello  "}],
         [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "and the world?"},
          {"role": "assistant", "content": "the world is naïve 東京"},
          {"role": "user", "content": "thanks"},
          {"role": "assistant", "content": "you are welcome"}],
         [{"role": "user", "content": "hello"},
          {"role": "assistant", "content": "hello world"},
          {"role": "user", "content": "what is the weather?"}]]  # ends with the user: nothing after is trained
FOLDERS = {"llama3": ("config", LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
           "qwen25": ("jinja", QWEN25, None, "<|im_end|>"),
           "mistral": ("config", MISTRAL, "<s>", "</s>")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-folders")
    corpus = " ".join(m["content"] for c in CHATS for m in c) * 8
    return {name: template_folder(root / name, kind, template, bos, eos, corpus)
            for name, (kind, template, bos, eos) in FOLDERS.items()}


def _jsonl(path, chats, field="messages"):
    path.write_text("".join(json.dumps({"id": i, field: c}) + "\n" for i, c in enumerate(chats)))
    return str(path)


def _docs(out):
    """Each training document's ids and loss mask (held_out=0: in record order)."""
    split = open_prepared(out).train
    return [(split.document(i), split.read_mask(int(split.docs[i]), int(split.docs[i + 1] - split.docs[i])))
            for i in range(split.documents)]


def _assistant_text(hf, chat):
    """What transformers renders for each assistant message after the generation prompt before it."""
    parts = []
    for i, m in enumerate(chat):
        if m["role"] == "assistant":
            before = hf.apply_chat_template(chat[:i], add_generation_prompt=True, tokenize=False)
            parts.append(hf.apply_chat_template(chat[:i + 1], tokenize=False)[len(before):])
    return parts


def test_tokens_equal_apply_chat_template_and_the_mask_is_the_assistants(tmp_path, folders):
    from transformers import AutoTokenizer

    src = _jsonl(tmp_path / "chats.jsonl", CHATS)
    for name in ("llama3", "qwen25"):
        hf = AutoTokenizer.from_pretrained(folders[name])
        out = tmp_path / name
        meta = prepare([src], str(folders[name]), out, workers=1, held_out=0.0, chat=ChatSpec(str(folders[name])))
        eos = meta["tokenizer"]["eos"]
        assert open_prepared(out).meta["format"] == "plait-tokens/3" and meta["chat"]["loss_on"] == "assistant"
        for chat, (ids, mask) in zip(CHATS, _docs(out), strict=True):
            want = list(hf.apply_chat_template(chat, tokenize=True, return_dict=False))
            assert ids.tolist() == want + [eos], name
            assert ids.tolist().count(hf.bos_token_id) == (name == "llama3")  # the template's BOS, once
            ends_assistant = chat[-1]["role"] == "assistant"
            assert mask[-1] == ends_assistant  # the EOS after an assistant's last turn: it learns to stop
            trained = hf.decode(ids[:-1][mask[:-1] == 1].tolist())
            assert trained == "".join(_assistant_text(hf, chat)), (name, trained)
    qwen = AutoTokenizer.from_pretrained(folders["qwen25"])
    ids, mask = _docs(tmp_path / "qwen25")[1]
    assert qwen.decode(ids[mask == 1].tolist()) == ("the world is naïve 東京<|im_end|>\nyou are welcome<|im_end|>\n"
                                                    "<|im_end|>")  # the last: the dataset's EOS


def test_a_records_tools_reach_the_template(tmp_path, folders):
    from transformers import AutoTokenizer

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    chat = [{"role": "user", "content": "the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny."}]
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"messages": chat, "tools": tools}) + "\n")
    meta = prepare([str(path)], str(folders["qwen25"]), tmp_path / "t", workers=1, held_out=0.0,
                   chat=ChatSpec(str(folders["qwen25"])))
    hf = AutoTokenizer.from_pretrained(folders["qwen25"])
    [(ids, mask)] = _docs(tmp_path / "t")
    assert ids.tolist() == list(hf.apply_chat_template(chat, tools=tools, tokenize=True, return_dict=False)) + [
        meta["tokenizer"]["eos"]]
    assert hf.decode(ids[mask == 1].tolist()) == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                                                 '"Paris"}}\n</tool_call><|im_end|>\nIt is sunny.<|im_end|>\n'
                                                 '<|im_end|>')  # the calls and the reply, not the tool's result
    path.write_text(json.dumps({"messages": chat, "tools": "get_weather"}) + "\n")
    with pytest.raises(ConfigError, match="tools.jsonl:1: 'tools' is str, not a list of function definitions"):
        prepare([str(path)], "bytes", tmp_path / "u", workers=1, chat=ChatSpec("bytes"))


def test_loss_on_all_and_a_folder_without_a_template(tmp_path, folders):
    src = _jsonl(tmp_path / "c.jsonl", CHATS[:2])
    meta = prepare([src], "bytes", tmp_path / "b", workers=1, held_out=0.0, chat=ChatSpec("bytes"))
    assert meta["chat"]["template"] == "plait's <|role|> format (--tokenizer bytes has no chat template)"
    (ids, mask), _ = _docs(tmp_path / "b")
    text = bytes(ids[:-1].astype(np.uint8)).decode()
    assert text == ("<|user|>\nhello world, what is the weather?\n<|assistant|>\n  the weather is hello  \n")
    assert bytes(ids[mask == 1].astype(np.uint8)) == b"  the weather is hello  \n\0"
    meta = prepare([src], "bytes", tmp_path / "all", workers=1, held_out=0.0, chat=ChatSpec("bytes", loss_on="all"))
    assert all(m.all() for _, m in _docs(tmp_path / "all"))
    assert meta["splits"]["train"]["loss_tokens"] == meta["splits"]["train"]["tokens"]
    (tmp_path / "bare").mkdir()  # a folder with a tokenizer but no template: plait's format too
    (tmp_path / "bare" / "tokenizer.json").write_bytes((folders["qwen25"] / "tokenizer.json").read_bytes())
    meta = prepare([src], str(tmp_path / "bare"), tmp_path / "b2", workers=1, held_out=0.0, eos="<|im_end|>",
                   chat=ChatSpec(str(tmp_path / "bare")))
    assert meta["chat"]["template"] == PLAIT_SOURCE


BYTES_CHAT = ChatSpec("bytes")


def _error(tmp_path, records, chat: ChatSpec | None = BYTES_CHAT, name="bad"):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ConfigError) as err:
        prepare([str(path)], "bytes" if chat is None else chat.tokenizer, tmp_path / f"{name}-out", workers=1,
                chat=chat)
    return str(err.value)


def test_bad_chat_records_name_the_file_and_line(tmp_path, folders):
    good = {"messages": CHATS[0]}
    msg = _error(tmp_path, [good, {"text": "no messages"}])
    assert "bad.jsonl:2: no 'messages' field (fields: text); choose --messages-field" in msg and "--skip-bad" in msg
    assert "bad.jsonl:2: 'messages' is an empty list, not a list of {role, content}" in _error(tmp_path,
                                                                                             [good, {"messages": []}])
    assert "bad.jsonl:1: 'messages' is str" in _error(tmp_path, [{"messages": "hi"}])
    assert "bad.jsonl:2: messages[1] has no role" in _error(tmp_path, [good, {"messages": [CHATS[0][0],
                                                                                            {"content": "x"}]}])
    assert "bad.jsonl:1: messages[0] (user) has no content" in _error(tmp_path, [{"messages": [{"role": "user"}]}])
    mistral = ChatSpec(str(folders["mistral"]))  # its template refuses a system message
    msg = _error(tmp_path, [{"messages": CHATS[0]}, {"messages": CHATS[1]}], mistral)
    assert "bad.jsonl:2: the chat template failed: TemplateError: Conversation roles must alternate" in msg
    msg = _error(tmp_path, [{"messages": CHATS[0]}], None)  # a chat file without --chat: the hint
    assert "bad.jsonl: its records have no 'text' field" in msg and "pass --chat to render them" in msg
    (tmp_path / "plain.txt").write_text("just text")
    with pytest.raises(ConfigError, match=r"--chat reads records of messages .* holds plain text"):
        prepare([str(tmp_path / "plain.txt")], "bytes", tmp_path / "p", chat=ChatSpec("bytes"))
    with pytest.raises(ConfigError, match="--loss-on everything: choose one of assistant, all"):
        prepare([_jsonl(tmp_path / "g.jsonl", CHATS)], "bytes", tmp_path / "q",
                chat=ChatSpec("bytes", loss_on="everything"))


def test_cli_chat_flags(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", CHATS, field="conversation")
    runner = CliRunner()
    res = runner.invoke(app, ["data", "prepare", src, "--tokenizer", "bytes", "--out", str(tmp_path / "a"),
                              "--messages-field", "conversation"])
    assert res.exit_code == 2 and "--messages-field reads chat records: add --chat" in res.output, res.output
    res = runner.invoke(app, ["data", "prepare", src, "--tokenizer", "bytes", "--out", str(tmp_path / "a"),
                              "--chat", "--messages-field", "conversation", "--workers", "1", "--held-out", "0"])
    assert res.exit_code == 0 and "the loss on assistant tokens (by prefixes)" in res.output, res.output
    train = open_prepared(tmp_path / "a").meta["splits"]["train"]
    assert train["documents"] == len(CHATS)
    share = f"{train['loss_tokens']:,} of the training split's {train['tokens']:,} ("  # the count and its whole
    assert share in " ".join(res.output.split()), res.output
    res = runner.invoke(app, ["data", "prepare", src, "--tokenizer", "bytes", "--out", str(tmp_path / "s"),
                              "--split-turns"])
    assert res.exit_code == 2 and "--split-turns reads chat records: add --chat" in res.output, res.output
    res = runner.invoke(app, ["data", "prepare", src, "--tokenizer", "bytes", "--out", str(tmp_path / "s"), "--chat",
                              "--messages-field", "conversation", "--split-turns", "--workers", "1", "--held-out", "0"])
    assert res.exit_code == 0 and "(by a document per assistant message)" in " ".join(res.output.split()), res.output
    assert open_prepared(tmp_path / "s").meta["splits"]["train"]["documents"] == 4  # 1 + 2 + 1 assistant messages
    res = runner.invoke(app, ["data", "prepare", src, "--tokenizer", "bytes", "--out", str(tmp_path / "b"),
                              "--chat", "--messages-field", "conversation", "--text-field", "body"])
    assert res.exit_code == 2 and "--text-field body: --chat reads --messages-field (conversation)" in res.output
    (tmp_path / "plain.txt").write_text("just text")
    res = runner.invoke(app, ["data", "prepare", str(tmp_path / "plain.txt"), "--tokenizer", "bytes", "--out",
                              str(tmp_path / "c"), "--text-field", "body"])
    assert res.exit_code == 2 and "--text-field body names a field" in res.output and "plain text" in res.output
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_train_on_a_raw_chat_file_names_the_prepare_with_chat(tmp_path):
    src = _jsonl(tmp_path / "c.jsonl", CHATS)
    res = CliRunner().invoke(app, ["train", "--data", src])
    assert res.exit_code == 2 and f"plait data prepare {src} --tokenizer bytes --chat --out DIR" in res.output, (
        res.output)


def test_masked_targets_and_the_loss_training_sees(tmp_path):
    from plait.models import Llama
    from plait.train import TrainConfig
    from plait.train.config import model_config

    chats = [[{"role": "user", "content": f"question {i}: " + "why " * (i % 5)},
              {"role": "assistant", "content": f"answer {i} " + "because " * (i % 3)}] for i in range(40)]
    prepare([_jsonl(tmp_path / "c.jsonl", chats)], "bytes", tmp_path / "set", workers=1, held_out=0.0,
            chat=ChatSpec("bytes"))
    split = open_prepared(tmp_path / "set").train
    data = open_data([str(tmp_path / "set")], "tiny", 256, 32, 4, seed=0, max_mb=1)
    assert "held out; chat: the loss on assistant tokens, " in data.describe()
    x, y = data.batch(0)
    full = torch.empty_like(y)  # every next token, the mask ignored
    for row in range(4):  # each row's window: targets outside the mask are IGNORE, the others the tokens
        w = int(data.order.locate(np.asarray([row]))[2][0])
        tokens, mask = split.read(w * 32, 33).astype(np.int64), split.read_mask(w * 32, 33)
        assert x[row].tolist() == tokens[:-1].tolist()
        assert y[row].tolist() == np.where(mask[1:] == 1, tokens[1:], IGNORE).tolist()
        full[row] = torch.from_numpy(tokens[1:])
    assert 0 < int((y != IGNORE).sum()) < y.numel()
    torch.manual_seed(0)
    model = Llama(model_config(TrainConfig.from_dict({"seq_len": 32, "batch_size": 4})))
    with torch.no_grad():
        logits = model(x).float()  # [4, 32, V]
    keep = y != IGNORE
    logp = torch.log_softmax(logits, -1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    by_hand = -(logp * keep).sum() / keep.sum()  # the mean over the assistant's tokens only
    with torch.no_grad():
        assert torch.allclose(model.loss(x, y), by_hand, rtol=1e-6)
        assert abs(float(model.loss(x, full)) - float(by_hand)) > 1e-3  # the mask changes what is averaged


def test_a_plait_tokens_1_dataset_still_reads_and_a_newer_one_is_refused(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [])
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "plain text " * 20}) + "\n")
    prepare([path], "bytes", tmp_path / "old", workers=1, held_out=0.0)
    meta = json.loads((tmp_path / "old" / META).read_text())
    (tmp_path / "old" / META).write_text(json.dumps({**meta, "format": "plait-tokens/1"}))
    ds = open_prepared(tmp_path / "old")
    assert not ds.train.masked and ds.train.read_mask(0, 5).tolist() == [1] * 5
    (tmp_path / "old" / META).write_text(json.dumps({**meta, "format": "plait-tokens/4"}))
    with pytest.raises(ConfigError, match="format 'plait-tokens/4', this plait reads plait-tokens/1, plait-tokens/2, "
                                          "plait-tokens/3"):
        open_prepared(tmp_path / "old")


def test_held_out_loss_is_the_mean_over_the_assistants_tokens(tmp_path):
    from types import SimpleNamespace

    from plait.documents import Documents
    from plait.models import Llama
    from plait.train import TrainConfig
    from plait.train.config import model_config
    from plait.train.loop import held_out_loss

    chats = [[{"role": "user", "content": f"q{i} " * 6}, {"role": "assistant", "content": f"a{i} " * 3}]
             for i in range(60)]
    prepare([_jsonl(tmp_path / "c.jsonl", chats)], "bytes", tmp_path / "set", workers=1, held_out=0.5,
            chat=ChatSpec("bytes"))
    data = open_data([str(tmp_path / "set")], "tiny", 256, 32, 4, seed=0, max_mb=1)
    torch.manual_seed(0)
    model = Llama(model_config(TrainConfig.from_dict({"seq_len": 32, "batch_size": 4}))).eval()
    run = SimpleNamespace(ctx=SimpleNamespace(dp_rank=0, dp_size=1, device=torch.device("cpu")), data=data,
                          pm=SimpleNamespace(eval_step=model, documents=Documents(None)))  # no document masking
    total, count = 0.0, 0
    for i in range(2):
        x, y = data.held_out_batch(i)
        keep = y != IGNORE
        with torch.no_grad():
            logp = torch.log_softmax(model(x).float(), -1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        total, count = total - float((logp * keep).sum()), count + int(keep.sum())
    assert 0 < count < 2 * y.numel()
    assert held_out_loss(run) == pytest.approx(total / count, rel=1e-6)


def _records(path, chats):
    """JSON lines of ``chats``, each with the Qwen3 tools when it calls one."""
    path.write_text("".join(json.dumps({"messages": c, **({"tools": QWEN3_TOOLS} if any(
        "tool_calls" in m for m in c) else {})}) + "\n" for c in chats))
    return str(path)


def test_generation_marks_give_the_mask_transformers_gives(tmp_path):
    from transformers import AutoTokenizer

    folder = template_folder(tmp_path / "marked", "jinja", QWEN3_MARKED, None, "<|im_end|>", "hello world " * 8)
    meta = prepare([_records(tmp_path / "c.jsonl", QWEN3_CHATS)], str(folder), tmp_path / "out", workers=1,
                   held_out=0.0, chat=ChatSpec(str(folder)))
    assert meta["chat"]["method"] == "{% generation %} marks"
    hf = AutoTokenizer.from_pretrained(folder)
    for chat, (ids, mask) in zip(QWEN3_CHATS, _docs(tmp_path / "out"), strict=True):
        tools = QWEN3_TOOLS if any("tool_calls" in m for m in chat) else None
        want = hf.apply_chat_template(chat, tools=tools, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert ids.tolist() == want["input_ids"] + [meta["tokenizer"]["eos"]]
        assert mask.tolist() == want["assistant_masks"] + [chat[-1]["role"] == "assistant"]
        assert 0 < mask.sum() < len(mask)
    # the first record's earlier turn, rendered without its reasoning in the whole conversation: its marked text
    ids, mask = _docs(tmp_path / "out")[0]
    assert hf.decode(ids[mask == 1].tolist()) == ("<|im_start|>assistant\nthe weather is hello<|im_end|>\n"
                                                 "<|im_start|>assistant\n<think>\nround\n</think>\n\nthe world is "
                                                 "round<|im_end|>\n<|im_end|>")  # the last: the dataset's EOS


# the assistant's text opens after "Bot " and closes before "ld": byte-level BPE tokens " hello" and "world" straddle
STRADDLED = ("{% for m in messages %}{% if m.role == 'assistant' %}Bot {% generation %}{{ m.content }}"
             "{% endgeneration %}ld{% else %}User: {{ m.content }}{% endif %}\n{% endfor %}")


def test_a_token_straddling_a_marked_span_is_in_the_loss_as_transformers_marks_it(tmp_path):
    from transformers import AutoTokenizer

    folder = template_folder(tmp_path / "straddled", "jinja", STRADDLED, None, "<|im_end|>", "hello world " * 8)
    chats = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello wor"}],
             [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world hello wor"},
              {"role": "user", "content": "world"}]]
    prepare([_records(tmp_path / "c.jsonl", chats)], str(folder), tmp_path / "out", workers=1, held_out=0.0,
            chat=ChatSpec(str(folder)))
    hf = AutoTokenizer.from_pretrained(folder)
    straddling = 0
    for chat, (ids, mask) in zip(chats, _docs(tmp_path / "out"), strict=True):
        want = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist()[:-1] == want["input_ids"]
        assert mask.tolist() == want["assistant_masks"] + [chat[-1]["role"] == "assistant"], chat
        text = hf.apply_chat_template(chat, tokenize=False)
        start = text.index("Bot ") + 4  # the first assistant message's first character
        end = start + len(chat[1]["content"])  # and the one after its last
        straddling += sum(a < edge < b for a, b in want.encodings[0].offsets for edge in (start, end))
    assert straddling >= 3, "too few tokens straddle a span's edge: the test tokenizer does not check the rule"


def test_qwen3_records_are_refused_naming_what_works_and_split_turns_trains_each_turn(tmp_path):
    from transformers import AutoTokenizer

    folder = template_folder(tmp_path / "qwen3", "config", QWEN3, None, "<|im_end|>", "hello world " * 8)
    src = _records(tmp_path / "c.jsonl", QWEN3_CHATS)
    with pytest.raises(ConfigError) as err:
        prepare([src], str(folder), tmp_path / "refused", workers=1, chat=ChatSpec(str(folder)))
    msg = str(err.value)
    assert "c.jsonl:1: the chat template (tokenizer_config.json) renders messages[2] or the messages before it " \
           "differently once later ones follow" in msg
    assert all(s in msg for s in ("--split-turns", "{% generation %}", "--loss-on all")), msg
    meta = prepare([src], str(folder), tmp_path / "turns", workers=1, held_out=0.0,
                   chat=ChatSpec(str(folder), split_turns=True))
    assert meta["chat"]["method"] == "a document per assistant message"
    hf, eos = AutoTokenizer.from_pretrained(folder), meta["tokenizer"]["eos"]
    want = []  # each assistant message: the conversation up to it, the loss after the generation prompt before it
    for chat in QWEN3_CHATS:
        tools = QWEN3_TOOLS if any("tool_calls" in m for m in chat) else None
        for i in [i for i, m in enumerate(chat) if m["role"] == "assistant"]:
            prompt = _hf_ids(hf, chat[:i], tools, add_generation_prompt=True)
            ids = _hf_ids(hf, chat[:i + 1], tools)
            assert ids[:len(prompt)] == prompt
            want.append((ids + [eos], [0] * len(prompt) + [1] * (len(ids) - len(prompt) + 1)))
    docs = _docs(tmp_path / "turns")
    assert [(ids.tolist(), mask.tolist()) for ids, mask in docs] == want and len(docs) == 6
    ids, mask = docs[0]  # the first turn keeps its reasoning in its own document
    assert hf.decode(ids[mask == 1].tolist()) == "<think>\nthey greet me\n</think>\n\nthe weather is hello" \
                                                  "<|im_end|>\n<|im_end|>"
    with pytest.raises(ConfigError, match="--split-turns puts the loss on each document's last assistant message"):
        prepare([src], str(folder), tmp_path / "x", chat=ChatSpec(str(folder), loss_on="all", split_turns=True))
    bad = _records(tmp_path / "bad.jsonl", [QWEN3_CHATS[0][:2]])
    with pytest.raises(ConfigError, match="bad.jsonl:1: no assistant message in messages: --split-turns makes no"):
        prepare([bad], str(folder), tmp_path / "y", chat=ChatSpec(str(folder), split_turns=True))


def _hf_ids(hf, chat, tools, **kw) -> list[int]:
    return list(hf.apply_chat_template(chat, tools=tools, tokenize=True, return_dict=False, **kw))


def test_split_turns_hold_out_a_conversations_documents_together(tmp_path):
    chats = [[{"role": "user", "content": f"question {r}"}, {"role": "assistant", "content": f"answer {r}"},
              {"role": "user", "content": "and then?"}, {"role": "assistant", "content": f"then {r * 7}"},
              {"role": "user", "content": "more?"}, {"role": "assistant", "content": "no more"}] for r in range(24)]
    meta = prepare([_jsonl(tmp_path / "c.jsonl", chats)], "bytes", tmp_path / "out", workers=1, held_out=0.5,
                   chat=ChatSpec("bytes", split_turns=True))
    ds = open_prepared(tmp_path / "out")
    records = {}
    for name, split in (("train", ds.train), ("held_out", ds.held_out)):
        for i in range(split.documents):
            text = bytes(split.document(i)[:-1].astype(np.uint8)).decode()
            records.setdefault(name, []).append(text.split("\n")[1])  # "question r"
    assert len(records["train"]) % 3 == 0 and len(records["held_out"]) % 3 == 0
    assert all(records["train"].count(q) == 3 for q in records["train"])
    assert not set(records["train"]) & set(records["held_out"]) and len(records["held_out"]) >= 3 * 4
    assert meta["splits"]["train"]["documents"] + meta["splits"]["held_out"]["documents"] == 3 * 24
