"""Chat messages to text: the model folder's own Jinja chat template, rendered as ``transformers``'
``apply_chat_template`` renders it (sandboxed), or plait's ``<|role|>`` format for a folder without one. Serving
renders prompts with it, ``plait data prepare --chat`` training conversations (with the character spans a
template's ``{% generation %}`` marks enclose)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from plait.tokenizers import read_json_object

# plait's own format, for folders without a template: "<|role|>\ncontent\n" per message, then "<|assistant|>\n"
PLAIT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PLAIT_SOURCE = "plait's <|role|> format (the folder has no chat template)"
# the tokenizer's named special tokens, passed to the template as variables (transformers' special_tokens_map)
SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING = ("reasoning_content", "thinking", "reasoning")  # a message's reasoning, under its usual names
MARKS = "__plait_generation_marks__"  # the template variable that asks the {% generation %} tag for OPEN and CLOSE
# variables chat_template_kwargs cannot set
RESERVED = {"messages", "tools", "documents", "add_generation_prompt", MARKS}
TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks the end of the last message (continue_final_message)
# While spans are asked for, a {% generation %} block's text is put between these two Unicode noncharacters
# (code points set aside for a program's internal use), then they are taken out and their places kept.
OPEN, CLOSE = "\ufdd0", "\ufdd1"


class ChatError(ValueError):
    """Messages or a template that cannot be rendered: the message, the request field it concerns and a code
    (serving answers it as a 400, data preparation names the record)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass(frozen=True)
class MessageProblem:
    """Why a chat's messages break the rule of ``message_problem``: ``index`` of the message (None: the list
    itself), ``field`` of it ("role", "content"; None: the message itself), ``kind`` ("null", "empty",
    "not_a_list", "not_an_object", "missing", "wrong_type") and the Python type name of the value found there."""

    index: int | None
    field: str | None
    kind: str
    found: str


def message_problem(messages: object) -> MessageProblem | None:
    """The first break of the chat-message rule, None if there is none: a non-empty list of objects, each with a
    string ``role`` and a non-null ``content``, except that an assistant message carrying ``tool_calls`` (or
    ``function_call``) may leave its content out or null, since the call is its reply (as OpenAI's API takes it).
    A template renders a missing content as nothing: a silently different text. Each caller words its own error."""
    if not isinstance(messages, list) or not messages:
        kind = "null" if messages is None else "empty" if messages == [] else "not_a_list"
        return MessageProblem(None, None, kind, type(messages).__name__)
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return MessageProblem(i, None, "not_an_object", type(m).__name__)
        role = m.get("role")
        if not isinstance(role, str):
            kind = "missing" if "role" not in m else "null" if role is None else "wrong_type"
            return MessageProblem(i, "role", kind, type(role).__name__)
        if m.get("content") is None and not (role == "assistant" and (m.get("tool_calls") or m.get("function_call"))):
            return MessageProblem(i, "content", "missing" if "content" not in m else "null", "NoneType")
    return None


def _is_file(path: Path) -> bool:
    """Whether ``path`` is a file; False for a name the system refuses (a template's text, longer than a name)."""
    try:
        return path.is_file()
    except OSError:
        return False


def _token_text(value) -> str | None:
    """A special token of tokenizer_config.json: a string or {"content": string}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(folder: Path) -> dict[str, str]:
    """The named special tokens of a folder (tokenizer_config.json, else special_tokens_map.json)."""
    out: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins where both name one
        data = read_json_object(folder / name)
        out.update({k: t for k in SPECIAL if (t := _token_text(data.get(k))) is not None})
    return out


def folder_templates(folder: Path) -> tuple[dict[str, str], str]:
    """(name -> template, where they came from) of a folder, empty when it has none.

    As transformers loads them: ``chat_template.jinja`` (the default) and ``additional_chat_templates/*.jinja``
    win over tokenizer_config.json's ``chat_template`` (a string, or a list of {"name", "template"}).
    """
    files = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        files.update({f.name.removesuffix(".jinja"): f.read_text(encoding="utf-8")
                      for f in sorted(extra.glob("*.jinja"))})
    if files:
        return files, "chat_template.jinja" if "default" in files else "additional_chat_templates/"
    value = read_json_object(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(value, str):
        return {"default": value}, "tokenizer_config.json"
    if isinstance(value, list):
        named = {t["name"]: t["template"] for t in value if isinstance(t, dict) and isinstance(t.get("name"), str)
                 and isinstance(t.get("template"), str)}
        return named, "tokenizer_config.json"
    return {}, ""


def _generation_extension():
    """The ``{% generation %}...{% endgeneration %}`` tag of Hugging Face chat templates (transformers'
    ``AssistantTracker``), around the text the assistant writes: its text is rendered as is, and between OPEN and
    CLOSE while ``ChatTemplate.render_spans`` runs."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            mark = self.call_method("_mark", [jinja2.nodes.ContextReference()])
            return jinja2.nodes.CallBlock(mark, [], [], body).set_lineno(lineno)

        def _mark(self, context, caller):
            text = caller()
            return f"{OPEN}{text}{CLOSE}" if context.get(MARKS) else text

    return Generation


@lru_cache(maxsize=1)
def _environment():
    """The sandbox templates compile in, with transformers' settings and helpers."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # no HTML escaping
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


@lru_cache(maxsize=32)
def compile_template(source: str):
    """A template compiled in the sandbox (raises TemplateSyntaxError)."""
    return _environment().from_string(source)


@lru_cache(maxsize=32)
def generation_marks(source: str) -> bool:
    """Whether a template has ``{% generation %}`` blocks (False for one that does not parse)."""
    import jinja2.nodes

    try:
        tree = _environment().parse(source)
    except Exception:  # a syntax error is reported when the template is rendered
        return False
    return any(isinstance(node, jinja2.nodes.ExtensionAttribute) and node.name == "_mark"
               for node in tree.find_all(jinja2.nodes.ExtensionAttribute))


@lru_cache(maxsize=32)
def iterates_content(source: str) -> bool:
    """Whether a template loops over a message's content (takes content as a list of parts, as vLLM detects it);
    otherwise text parts are joined with newlines into one string first."""
    import jinja2.nodes

    try:
        tree = _environment().parse(source)
    except Exception:  # a syntax error is reported when the template is rendered
        return False
    for loop in tree.find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return True
        if isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const) \
                and it.arg.value == "content":
            return True
    return False


def _content(value, as_parts: bool, where: str):
    """A message's content: a string, None, or a list of text parts (kept as parts or joined)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ChatError(f"{where}.content must be a string or a list of content parts", "messages")
    texts = []
    for j, part in enumerate(value):
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        if not isinstance(part, dict) or part.get("type", "text") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatError(f"{where}.content[{j}]: only text parts are supported, not {kind!r}", "messages",
                           "unsupported")
        texts.append(dict(part))
    return texts if as_parts else "\n".join(p["text"] for p in texts)


def normalize(messages, as_parts: bool) -> list[dict]:
    """Messages as the template sees them: keys holding null dropped (as transformers), content normalised,
    a message's reasoning under every name templates read it by."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ChatError("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise ChatError(f"messages[{i}].role must be a string", "messages")
        m = {k: v for k, v in m.items() if v is not None}
        if "content" in m:
            m["content"] = _content(m["content"], as_parts, f"messages[{i}]")
        reasoning = next((m[k] for k in REASONING if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """A folder's chat templates (else plait's format) and its special tokens; ``render`` turns messages into
    text, as ``tokenizer.apply_chat_template(..., tokenize=False)`` does."""

    def __init__(self, folder: str | Path | None, override: str | None = None, trust_request: bool = False):
        path = Path(folder) if folder is not None else None
        self.special = special_tokens(path) if path is not None and path.is_dir() else {}
        self.templates, self.source = folder_templates(path) if path is not None and path.is_dir() else ({}, "")
        if override is not None:  # --chat-template: a file, else the template itself
            file = Path(override)
            if not _is_file(file) and not any(c in override for c in "{}\n"):
                from plait.errors import ConfigError  # a template without any Jinja would ignore the messages

                raise ConfigError(f"--chat-template {override}: no such file, and not a template (no {{{{ }}}} or "
                                  "{% %}); pass a Jinja template file or the template's text")
            self.templates = {"default": file.read_text(encoding="utf-8") if _is_file(file) else override}
            self.source = f"--chat-template {override if _is_file(file) else '(inline)'}"
        elif not self.templates:
            self.templates, self.source = {"default": PLAIT_TEMPLATE}, PLAIT_SOURCE
        self.trust_request = trust_request

    @property
    def default(self) -> str | None:
        return self.templates.get("default")

    def pick(self, requested: str | None, tools: list[Any] | None) -> str:
        """The template source for a request: a named template or a template of its own, else the default
        (``tool_use`` when tools are given and the folder names one)."""
        if requested is not None:
            if requested in self.templates:
                return self.templates[requested]
            if not self.trust_request:
                raise ChatError("chat_template: a template sent with the request is refused unless the server "
                                f"runs with --trust-request-chat-template (named templates: "
                                f"{sorted(self.templates)})", "chat_template")
            return requested
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatError(f"this model has several chat templates and none is the default: name one in "
                        f"chat_template ({sorted(self.templates)})", "chat_template")

    def render(self, messages: object, add_generation_prompt: bool = True, tools: list[Any] | None = None,
               documents: list[Any] | None = None, template: str | None = None, kwargs: dict | None = None,
               continue_final: bool = False, marks: bool = False) -> str:
        """The text of ``messages`` (a non-empty list of {role, content} objects); ChatError naming the error when
        they or the template fail.

        ``continue_final``: the text ends inside the last message, so the model goes on with it (as
        transformers: a tag after its content, the text cut at the tag). ``marks``: the text of ``{% generation
        %}`` blocks between OPEN and CLOSE (``render_spans``)."""
        source = self.pick(template, tools)
        kwargs = kwargs or {}
        if set(kwargs) & RESERVED:
            raise ChatError(f"chat_template_kwargs may not set {sorted(set(kwargs) & RESERVED)}",
                            "chat_template_kwargs")
        if continue_final and add_generation_prompt:
            raise ChatError("continue_final_message and add_generation_prompt cannot both be true",
                            "continue_final_message")
        chat = normalize(messages, iterates_content(source))
        final = _tag_final(chat, source) if continue_final else None
        try:
            text = compile_template(source).render(messages=chat, tools=tools, documents=documents,
                                                   add_generation_prompt=add_generation_prompt,
                                                   **{**self.special, **kwargs, MARKS: marks})
        except Exception as exc:  # the template is the folder's or the request's code: any failure is the caller's
            raise ChatError(f"the chat template failed: {type(exc).__name__}: {exc}", "messages",
                            "chat_template_error") from None
        return text if final is None else _cut_at_tag(text, final)

    def render_spans(self, messages: object, add_generation_prompt: bool = False, tools: list[Any] | None = None,
                     kwargs: dict | None = None) -> tuple[str, list[tuple[int, int]] | None]:
        """The text of ``messages`` (as ``render``) and the sorted, disjoint character ranges [a, b) of it that the
        template's ``{% generation %}`` blocks enclose (the assistant's text, as transformers'
        ``return_assistant_tokens_mask`` takes it); None for spans when the template has no such blocks."""
        source = self.pick(None, tools)
        if not generation_marks(source):
            return self.render(messages, add_generation_prompt, tools, kwargs=kwargs), None
        if re.search(f"[{OPEN}{CLOSE}]", json.dumps([messages, tools, kwargs], ensure_ascii=False, default=str)):
            raise ChatError("the messages, tools or template variables hold U+FDD0 or U+FDD1, the noncharacters "
                            "that mark the template's {% generation %} text here", "messages")
        return _unmark(self.render(messages, add_generation_prompt, tools, kwargs=kwargs, marks=True))


def _unmark(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """The text without OPEN and CLOSE, and the ranges between them (nested blocks count as one; a block that
    ends where the last one began is joined to it; empty ones are left out)."""
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    at = depth = start = 0
    for piece in re.split(f"([{OPEN}{CLOSE}])", marked):
        if piece == OPEN:
            start, depth = (at if depth == 0 else start), depth + 1
        elif piece == CLOSE:
            depth -= 1
            if depth == 0 and at > start:
                spans[-1:] = [(spans[-1][0], at)] if spans and spans[-1][1] == start else [*spans[-1:], (start, at)]
        else:
            parts.append(piece)
            at += len(piece)
    return "".join(parts), spans


def _tag_final(chat: list[dict], source: str) -> str:
    """Put TAG after the last message's text (its last text part); that text."""
    last = chat[-1].get("content")
    if last is None or "content" not in source:
        raise ChatError("continue_final_message: the last message has no content the template shows",
                       "continue_final_message")
    if isinstance(last, list):
        part = next((p for p in reversed(last) if "text" in p), None)
        if part is None:
            raise ChatError("continue_final_message: the last message has no text", "continue_final_message")
        final, part["text"] = part["text"], part["text"] + TAG
    else:
        final, chat[-1]["content"] = last, last + TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    """The rendered text up to the tag (and without the whitespace the template trimmed before it)."""
    if final.strip() not in text or TAG.strip() not in text:
        raise ChatError("continue_final_message: the chat template dropped part of the last message",
                       "continue_final_message")
    at = text.rindex(TAG.strip())
    return text[:at] if text[at: at + len(TAG)] == TAG else text[:at].rstrip()


def chat_prompt(messages: list[dict]) -> str:
    """plait's own format of ``messages`` with the generation prompt (what a folder without a template gets)."""
    return ChatTemplate(None).render(messages)


def check_template(folder: str, override: str | None) -> None:
    """ConfigError when the chat template a server would use (the folder's, or --chat-template) does not compile."""
    from plait.errors import ConfigError

    chat = ChatTemplate(folder, override)
    for name, source in chat.templates.items():
        try:
            compile_template(source)
        except Exception as exc:  # jinja2's TemplateSyntaxError names the line
            where = "--chat-template" if override is not None else f"{folder}: chat template {name!r}"
            raise ConfigError(f"{where} ({chat.source}) does not compile: {type(exc).__name__}: {exc}") from None
