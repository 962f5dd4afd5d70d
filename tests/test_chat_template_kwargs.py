"""--chat-template-kwargs: template variables from the command line. plait data prepare --chat gives them to every
render (prefixes, {% generation %} marks, --split-turns: Qwen3 with enable_thinking false equals transformers'
apply_chat_template(..., enable_thinking=False)); plait serve to every chat request, a request's own
chat_template_kwargs overriding them key by key; a bad value is refused naming the flag before any work."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from chat_templates import QWEN3, QWEN3_TOOLS, template_folder
from plait.chat_kwargs import parse_template_kwargs
from plait.chat_template import ChatTemplate
from plait.cli.main import app
from plait.data import open_prepared, prepare
from plait.data.chat import ChatSpec
from plait.errors import ConfigError
from plait.serve.config import ServeConfig
from plait.serve.tokens import TokenizerInfo
from plait.tokenizers import ByteTokenizer

pytest.importorskip("transformers")

OFF = {"enable_thinking": False}
ONE_TURN = [{"role": "user", "content": "hello world, what is the weather?"},
            {"role": "assistant", "content": "the weather is hello"}]
# Qwen3 conversations without reasoning (what enable_thinking false trains): several turns, tool calls and results
TURNS = [[{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "hello world"},
          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and the world?"},
          {"role": "assistant", "content": "the world is round"}],
         [{"role": "user", "content": "the weather in Paris?"},
          {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
              "name": "get_weather", "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "content": "sunny"},
          {"role": "assistant", "content": "Paris is sunny."}]]
# a {% generation %} block that shows a variable: the marks path renders with the variables too
SIGNED = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
          "{{ m.content }}{% if signature is defined %} -- {{ signature }}{% endif %}<|im_end|>{% endgeneration %}"
          "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return template_folder(tmp_path_factory.mktemp("qwen3"), "config", QWEN3, None, "<|im_end|>", "hello world " * 8)


def _records(path, chats) -> str:
    path.write_text("".join(json.dumps({"messages": c, **({"tools": QWEN3_TOOLS} if any(
        "tool_calls" in m for m in c) else {})}) + "\n" for c in chats))
    return str(path)


def _docs(out) -> list[tuple[list[int], list[int]]]:
    split = open_prepared(out).train
    return [(split.document(i).tolist(), split.read_mask(int(split.docs[i]), int(split.docs[i + 1] - split.docs[i]))
             .tolist()) for i in range(split.documents)]


def _turn(hf, chat, eos, **kw) -> tuple[list[int], list[int]]:
    """transformers' ids of ``chat`` (+ the EOS) and the loss on what follows the generation prompt before its last
    message."""
    tools = QWEN3_TOOLS if any("tool_calls" in m for m in chat) else None
    prompt = hf.apply_chat_template(chat[:-1], tools=tools, add_generation_prompt=True, tokenize=True,
                                    return_dict=False, **kw)
    ids = hf.apply_chat_template(chat, tools=tools, tokenize=True, return_dict=False, **kw)
    assert ids[:len(prompt)] == prompt
    return ids + [eos], [0] * len(prompt) + [1] * (len(ids) - len(prompt) + 1)


def test_prepare_renders_qwen3_without_thinking_as_transformers(tmp_path, qwen3):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen3)
    src = _records(tmp_path / "one.jsonl", [ONE_TURN])
    meta = prepare([src], str(qwen3), tmp_path / "prefix", workers=1, held_out=0.0,
                   chat=ChatSpec(str(qwen3), template_kwargs=OFF))
    eos = meta["tokenizer"]["eos"]
    assert meta["chat"]["method"] == "prefixes" and meta["chat"]["template_kwargs"] == OFF
    assert _docs(tmp_path / "prefix") == [_turn(hf, ONE_TURN, eos, enable_thinking=False)]
    # without the variable the empty <think></think> is the assistant's (in the loss), not the prompt's
    prepare([src], str(qwen3), tmp_path / "thinking", workers=1, held_out=0.0, chat=ChatSpec(str(qwen3)))
    assert _docs(tmp_path / "thinking") == [_turn(hf, ONE_TURN, eos)] != _docs(tmp_path / "prefix")

    res = CliRunner().invoke(app, ["data", "prepare", _records(tmp_path / "turns.jsonl", TURNS), "--tokenizer",
                                   str(qwen3), "--out", str(tmp_path / "turns"), "--chat", "--split-turns",
                                   "--chat-template-kwargs", '{"enable_thinking": false}', "--workers", "1",
                                   "--held-out", "0"])
    assert res.exit_code == 0, res.output
    assert 'and variables {"enable_thinking": false}' in " ".join(res.output.split()), res.output
    assert json.loads((tmp_path / "turns" / "meta.json").read_text())["chat"]["template_kwargs"] == OFF
    want = [_turn(hf, chat[:i + 1], eos, enable_thinking=False)
            for chat in TURNS for i, m in enumerate(chat) if m["role"] == "assistant"]
    assert _docs(tmp_path / "turns") == want and len(want) == 4


def test_prepare_gives_the_variables_to_generation_marks(tmp_path):
    from transformers import AutoTokenizer

    folder = template_folder(tmp_path / "signed", "jinja", SIGNED, None, "<|im_end|>", "hello world " * 8)
    meta = prepare([_records(tmp_path / "c.jsonl", [ONE_TURN, TURNS[0]])], str(folder), tmp_path / "out",
                   workers=1, held_out=0.0, chat=ChatSpec(str(folder), template_kwargs={"signature": "bot"}))
    assert meta["chat"]["method"] == "{% generation %} marks"
    hf = AutoTokenizer.from_pretrained(folder)
    for chat, (ids, mask) in zip([ONE_TURN, TURNS[0]], _docs(tmp_path / "out"), strict=True):
        want = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                      signature="bot")
        assert ids == want["input_ids"] + [meta["tokenizer"]["eos"]]
        assert mask == want["assistant_masks"] + [1]
    assert hf.decode([t for t, m in zip(*_docs(tmp_path / "out")[0], strict=True) if m]) == \
        "the weather is hello -- bot<|im_end|><|im_end|>"  # the last: the dataset's EOS


@pytest.mark.parametrize("value, message", [
    ("{bad", "--chat-template-kwargs {bad: not JSON"),
    ("[1]", "--chat-template-kwargs: an array, not a JSON object of template variables"),
    ('"x"', "--chat-template-kwargs: a string, not a JSON object"),
    ('{"add_generation_prompt": true, "messages": []}', "--chat-template-kwargs may not set add_generation_prompt, "
                                                        "messages: the renderer sets them")])
def test_a_bad_value_is_refused_naming_the_flag_before_any_work(tmp_path, value, message):
    src = _records(tmp_path / "c.jsonl", [ONE_TURN])
    runner = CliRunner()
    res = runner.invoke(app, ["data", "prepare", src, "--tokenizer", "bytes", "--out", str(tmp_path / "out"),
                              "--chat", "--chat-template-kwargs", value])
    assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output
    with pytest.raises(ConfigError, match="--chat-template-kwargs"):
        ServeConfig(chat_template_kwargs=value).resolved(128)
    assert not (tmp_path / "out").exists()
    res = runner.invoke(app, ["data", "prepare", src, "--tokenizer", "bytes", "--out", str(tmp_path / "out"),
                              "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert res.exit_code == 2 and "--chat-template-kwargs reads chat records: add --chat" in res.output, res.output
    with pytest.raises(ConfigError, match="--chat-template-kwargs may not set messages"):
        prepare([src], "bytes", tmp_path / "out", chat=ChatSpec("bytes", template_kwargs={"messages": []}))
    assert not (tmp_path / "out").exists()


def test_serve_defaults_reach_every_chat_and_a_request_overrides_them_key_by_key(qwen3):
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from plait.serve.metrics import Metrics
    from plait.serve.protocol import Limits
    from plait.serve.server import Api
    from plait.tokenizers import FileTokenizer

    def client(tokens: TokenizerInfo) -> TestClient:
        return TestClient(Api(None, Limits("m", 512, 512, 16, 512), tokens, Metrics(), max_queue=4).app())

    chat = TURNS[0][:4]
    hf = AutoTokenizer.from_pretrained(qwen3)
    served = client(TokenizerInfo(FileTokenizer(qwen3 / "tokenizer.json"), str(qwen3), 512, ChatTemplate(qwen3),
                                  parse_template_kwargs('{"enable_thinking": false}')))
    for body, kw in (({}, OFF), ({"chat_template_kwargs": {"enable_thinking": True}}, {"enable_thinking": True})):
        res = served.post("/tokenize", json={"messages": chat, **body})
        assert res.status_code == 200, res.text
        assert res.json()["tokens"] == hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                              return_dict=False, **kw), body
    own = ChatTemplate(None, "{{ greeting }}, {{ name }}: {% for m in messages %}{{ m.content }}{% endfor %}")
    served = client(TokenizerInfo(ByteTokenizer(), "/nonexistent", 512, own, {"greeting": "hi", "name": "you"}))
    for body, text in (({}, "hi, you: hello"), ({"chat_template_kwargs": {"name": "bob"}}, "hi, bob: hello")):
        res = served.post("/tokenize", json={"messages": [{"role": "user", "content": "hello"}], **body})
        assert bytes(res.json()["tokens"]).decode() == text, res.text
    # vLLM's merge: a request's null or "auto" keeps the server's value; without server defaults it is sent as is
    for body, text in (({"chat_template_kwargs": {"name": None}}, "hi, you: hello"),
                       ({"chat_template_kwargs": {"name": "auto", "greeting": None}}, "hi, you: hello"),
                       ({"chat_template_kwargs": {"name": None, "greeting": "yo"}}, "yo, you: hello")):
        res = served.post("/tokenize", json={"messages": [{"role": "user", "content": "hello"}], **body})
        assert bytes(res.json()["tokens"]).decode() == text, (body, res.text)
    bare = client(TokenizerInfo(ByteTokenizer(), "/nonexistent", 512, own))
    res = bare.post("/tokenize", json={"messages": [{"role": "user", "content": "hello"}],
                                       "chat_template_kwargs": {"greeting": "auto", "name": None}})
    assert bytes(res.json()["tokens"]).decode() == "auto, None: hello", res.text
    res = served.post("/tokenize", json={"messages": [{"role": "user", "content": "hello"}],
                                         "chat_template_kwargs": {"tools": []}})
    assert res.status_code == 400 and "chat_template_kwargs may not set ['tools']" in res.text


def test_serve_takes_the_flag_under_both_names(tmp_path):
    from serve_util import tiny_model

    model = tiny_model(tmp_path / "m")
    for flag in ("--chat-template-kwargs", "--default-chat-template-kwargs"):
        res = CliRunner().invoke(app, ["serve", "--model", str(model), flag, '{"messages": 1}'])
        assert res.exit_code == 2 and "--chat-template-kwargs may not set messages" in res.output, res.output
    shown = " ".join(CliRunner().invoke(app, ["serve", "--help"]).output.split())
    assert "--chat-template-kwargs, --default-chat-template-kwargs JSON Template variables" in shown, shown
