"""Chat templates: plait serve's prompt ids equal transformers' apply_chat_template for real templates (Llama-3,
Llama-3.2 with tools, Qwen2.5 ChatML, Qwen2-VL content parts, Mistral, Qwen3 with reasoning and tools), errors as
400s, plait's own format; {% generation %} marks ignored in serving, their spans those transformers masks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chat_templates import LLAMA3, LLAMA32, MISTRAL, QWEN2_VL, QWEN3_CHATS, QWEN3_TOOLS, QWEN25, template_folder
from plait.chat_template import PLAIT_SOURCE, ChatError, ChatTemplate, chat_prompt
from plait.errors import ConfigError
from plait.serve.protocol import ApiError
from plait.serve.tokens import TokenizerInfo
from plait.tokenizers import ByteTokenizer, FileTokenizer

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "Its name <b>&</b>"}},
                                               "required": ["city"]}}}]
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "hello world, what is the weather?"},
        {"role": "assistant", "content": "  the weather is hello  "},
        {"role": "user", "content": "and the world?"}]
TOOL_CHAT = [{"role": "user", "content": "the weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                 "name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "sunny"}]
MISTRAL_TOOLS = "{{ bos_token }}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]" + MISTRAL.removeprefix(
    "{{ bos_token }}")
# folder -> (how its template is stored, template, bos, eos)
FOLDERS = {"llama3": ("config", LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
           "llama32": ("jinja", LLAMA32, "<|begin_of_text|>", "<|eot_id|>"),
           "qwen25": ("jinja", QWEN25, None, "<|im_end|>"),
           "qwen2vl": ("config", QWEN2_VL, None, "<|im_end|>"),
           "mistral": ("named", [{"name": "default", "template": MISTRAL},
                                 {"name": "tool_use", "template": MISTRAL_TOOLS}], "<s>", "</s>")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """One tokenizer folder per family (chat_templates.template_folder), the template stored as such models
    store it. The Llama folders add a BOS to every text."""
    root = tmp_path_factory.mktemp("chat")
    corpus = " ".join(m["content"] for m in CHAT) * 8
    return {name: template_folder(root / name, kind, template, bos, eos, corpus)
            for name, (kind, template, bos, eos) in FOLDERS.items()}


def _pair(path: Path, trust: bool = False):
    from transformers import AutoTokenizer

    info = TokenizerInfo(FileTokenizer(path / "tokenizer.json"), str(path), 512, ChatTemplate(path, None, trust))
    return info, AutoTokenizer.from_pretrained(path)


def _hf(hf, messages, **kw) -> list[int]:
    return list(hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


def test_prompt_ids_equal_apply_chat_template(folders):
    for name in ("llama3", "llama32", "qwen25", "qwen2vl"):
        info, hf = _pair(folders[name])
        for generation in (True, False):
            got = info.chat_ids({"messages": CHAT, "add_generation_prompt": generation})
            assert got == _hf(hf, CHAT, add_generation_prompt=generation), (name, generation)
        assert info.chat_ids({"messages": CHAT}) == _hf(hf, CHAT, add_generation_prompt=True)  # vLLM's default
        assert info.chat.source == ("chat_template.jinja" if FOLDERS[name][0] == "jinja" else "tokenizer_config.json")
    info, hf = _pair(folders["llama3"])
    assert info.chat_ids({"messages": CHAT})[0] == hf.bos_token_id  # once: the template's, not the tokenizer's too
    assert info.chat_ids({"messages": CHAT, "add_special_tokens": True})[:2] == [hf.bos_token_id] * 2
    info, hf = _pair(folders["mistral"])
    chat = CHAT[1:]
    assert info.chat_ids({"messages": chat}) == _hf(hf, chat, add_generation_prompt=True)


def test_tools_kwargs_and_named_templates_equal_apply_chat_template(folders):
    for name in ("llama32", "qwen25"):
        info, hf = _pair(folders[name])
        chat = TOOL_CHAT if name == "qwen25" else TOOL_CHAT[:1]
        got = info.chat_ids({"messages": chat, "tools": TOOLS})
        assert got == _hf(hf, chat, tools=TOOLS, add_generation_prompt=True), name
        assert "<b>&</b>" in hf.decode(got)  # tojson without HTML escaping
    info, hf = _pair(folders["llama32"])
    body = {"messages": CHAT, "chat_template_kwargs": {"date_string": "01 Jan 2025"}}
    assert info.chat_ids(body) == _hf(hf, CHAT, add_generation_prompt=True, date_string="01 Jan 2025")
    assert "01 Jan 2025" in hf.decode(info.chat_ids(body))
    info, hf = _pair(folders["mistral"])
    chat = CHAT[1:]
    assert info.chat_ids({"messages": chat, "tools": TOOLS}) == _hf(hf, chat, tools=TOOLS, add_generation_prompt=True)
    named = info.chat_ids({"messages": chat, "chat_template": "tool_use"})
    assert named == _hf(hf, chat, chat_template="tool_use", add_generation_prompt=True)
    assert named != info.chat_ids({"messages": chat})


def test_content_parts_kept_for_templates_that_loop_over_them_else_joined(folders):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]}]
    info, hf = _pair(folders["qwen2vl"])
    assert info.chat_ids({"messages": parts}) == _hf(hf, parts, add_generation_prompt=True)
    joined = [{"role": "user", "content": "hello\nworld"}]
    for name in ("llama3", "qwen25"):
        info, hf = _pair(folders[name])
        assert info.chat_ids({"messages": parts}) == _hf(hf, joined, add_generation_prompt=True), name
    with pytest.raises(ApiError, match="only text parts") as err:
        info.chat_ids({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert err.value.status == 400


def test_continue_final_message_equals_apply_chat_template(folders):
    prefill = [*CHAT[:2], {"role": "assistant", "content": "The weather is"}]
    parts = [*CHAT[:2], {"role": "assistant", "content": [{"type": "text", "text": "The weather is "}]}]
    for name, chat in (("llama3", prefill), ("qwen25", prefill), ("qwen2vl", parts)):
        info, hf = _pair(folders[name])
        got = info.chat_ids({"messages": chat, "continue_final_message": True, "add_generation_prompt": False})
        assert got == _hf(hf, chat, continue_final_message=True), name
        assert hf.decode(got).rstrip().endswith("The weather is"), (name, hf.decode(got)[-40:])
    with pytest.raises(ApiError, match="cannot both be true"):
        info.chat_ids({"messages": prefill, "continue_final_message": True})


def test_template_errors_are_400s_naming_them(folders):
    info, _ = _pair(folders["mistral"])
    with pytest.raises(ApiError, match="TemplateError: Conversation roles must alternate") as err:
        info.chat_ids({"messages": CHAT})  # a system message: Mistral's template refuses it
    assert err.value.status == 400 and err.value.code == "chat_template_error"
    with pytest.raises(ApiError, match="--trust-request-chat-template"):
        info.chat_ids({"messages": CHAT[1:2], "chat_template": "{{ messages }}"})
    trusted, hf = _pair(folders["qwen25"], trust=True)
    own = "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}"
    assert trusted.chat_ids({"messages": CHAT, "chat_template": own}) == _hf(hf, CHAT, chat_template=own,
                                                                               add_generation_prompt=True)
    for bad, kind in (("{% for m in messages %}", "TemplateSyntaxError"),
                      ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
                      ("{{ raise_exception('no system prompt here') }}", "no system prompt here")):
        with pytest.raises(ApiError, match=kind) as err:
            trusted.chat_ids({"messages": CHAT, "chat_template": bad})
        assert err.value.status == 400
    with pytest.raises(ApiError, match="chat_template_kwargs may not set"):
        trusted.chat_ids({"messages": CHAT, "chat_template_kwargs": {"messages": []}})


def test_a_folder_without_a_template_gets_plaits_format(tmp_path):
    info = TokenizerInfo(ByteTokenizer(), str(tmp_path), 128)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text",
                                                                                           "text": "Hi"}]}]
    assert chat_prompt(messages) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert info.chat_ids({"messages": messages}) == list(b"<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n")
    assert info.chat.source == PLAIT_SOURCE and info.info()["chat_template_source"] == PLAIT_SOURCE
    no_prompt = info.chat_ids({"messages": messages, "add_generation_prompt": False})
    assert bytes(no_prompt).decode() == "<|system|>\nBe brief.\n<|user|>\nHi\n"


def test_a_checkpoint_takes_the_template_of_the_folder_it_was_trained_from(folders, tmp_path):
    from plait.checkpoint.writer import FORMAT, META
    from plait.generation.job import tokenizer_folder

    ckpt = tmp_path / "ckpt"
    (ckpt / "step_5").mkdir(parents=True, exist_ok=True)
    for trained_on, want in ((folders["llama3"], str(folders["llama3"])), ("tiny", str(ckpt))):
        (ckpt / "step_5" / META).write_text(json.dumps({"format": FORMAT, "train": {"model": str(trained_on)}}))
        assert tokenizer_folder(str(ckpt)) == want
    (ckpt / "step_5" / META).write_text(json.dumps({"format": FORMAT, "train": {"model": str(tmp_path / "gone")}}))
    with pytest.raises(ConfigError, match="trained with the tokenizer of .*gone, and .* is not there"):
        tokenizer_folder(str(ckpt))  # its ids would be decoded as UTF-8 bytes
    assert ChatTemplate(tokenizer_folder(str(folders["llama3"]))).source == "tokenizer_config.json"


def test_qwen3_template_equals_apply_chat_template(tmp_path):
    from chat_templates import QWEN3

    info, hf = _pair(template_folder(tmp_path / "qwen3", "config", QWEN3, None, "<|im_end|>", "hello world " * 8))
    for chat in QWEN3_CHATS:
        tools = QWEN3_TOOLS if any("tool_calls" in m for m in chat) else None
        for body in ({}, {"add_generation_prompt": False}, {"chat_template_kwargs": {"enable_thinking": False}}):
            got = info.chat_ids({"messages": chat, "tools": tools, **body})
            kw = {"add_generation_prompt": body.get("add_generation_prompt", True), **body.get("chat_template_kwargs",
                                                                                               {})}
            assert got == _hf(hf, chat, tools=tools, **kw), (chat, body)
    text = ChatTemplate(None, QWEN3).render(QWEN3_CHATS[0], add_generation_prompt=False)  # inline, 4 kB of text
    assert "they greet me" not in text and "<think>\nround\n</think>\n\nthe world is round" in text  # past reasoning
    text = ChatTemplate(None, QWEN3).render(QWEN3_CHATS[2], tools=QWEN3_TOOLS)
    assert "<think>\na tool knows\n</think>" in text  # after the last user query: kept
    assert '{"name": "get_weather", "arguments": {"city": "Lyon"}}' in text  # arguments given as a string
    prefill = [*QWEN3_CHATS[1][:2], {"role": "user", "content": "why?"}, {"role": "assistant", "content": "Because"}]
    got = info.chat_ids({"messages": prefill, "continue_final_message": True, "add_generation_prompt": False})
    assert got == _hf(hf, prefill, continue_final_message=True)


def _merged(spans) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if b > a:
            out[-1:] = [(out[-1][0], max(b, out[-1][1]))] if out and out[-1][1] >= a else [*out[-1:], (a, b)]
    return out


def test_generation_marks_render_as_transformers_and_enclose_the_spans_it_masks(tmp_path):
    from transformers.utils.chat_template_utils import render_jinja_template

    from chat_templates import QWEN3, QWEN3_MARKED

    info, hf = _pair(template_folder(tmp_path / "marked", "jinja", QWEN3_MARKED, None, "<|im_end|>", "hello " * 8))
    plain = ChatTemplate(None, QWEN3)
    for chat in QWEN3_CHATS:
        tools = QWEN3_TOOLS if any("tool_calls" in m for m in chat) else None
        got = info.chat_ids({"messages": chat, "tools": tools})  # serving: the marks change nothing
        assert got == _hf(hf, chat, tools=tools, add_generation_prompt=True)
        assert hf.decode(got) == plain.render(chat, tools=tools)
        text, spans = info.chat.render_spans(chat, tools=tools)
        [want], [indices] = render_jinja_template([chat], tools=tools, chat_template=QWEN3_MARKED,
                                                  return_assistant_tokens_mask=True)
        assert text == want == plain.render(chat, add_generation_prompt=False, tools=tools)
        assert spans == _merged(indices) and len(spans) == sum(m["role"] == "assistant" for m in chat), chat
        assert all(text[a:b].startswith("<|im_start|>assistant\n") and text[a:b].endswith("<|im_end|>\n")
                   for a, b in spans)
    assert plain.render_spans(QWEN3_CHATS[0])[1] is None  # no marks: no spans
    nested = ChatTemplate(None, "{% macro say(m) %}{% generation %}{{ m.content }}{% endgeneration %}{% endmacro %}"
                                "{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{{ say(m) }}"
                                "{% else %}{{ m.content }}{% endif %}{% endfor %}")
    text, [(a, b)] = nested.render_spans(QWEN3_CHATS[1])  # a block inside a macro
    assert text == "<user>hello world<assistant><think>\nhmm\n</think>\n\nhello<user>what is the weather?"
    assert text[a:b] == QWEN3_CHATS[1][1]["content"]
    parts = ChatTemplate(None, "{% for m in messages %}{% generation %}{% for p in m['content'] %}{{ p['text'] }}|"
                               "{% endfor %}{% endgeneration %}{% endfor %}")  # a marked loop over content parts
    chat = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert parts.render(chat) == "a|b|" and parts.render_spans(chat) == ("a|b|", [(0, 4)])
    with pytest.raises(ChatError, match="U[+]FDD0 or U[+]FDD1"):
        nested.render_spans([{"role": "user", "content": "a\ufdd0b"}])
