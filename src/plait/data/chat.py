"""Chat records for ``plait data prepare --chat``: a record's messages rendered with the model folder's chat
template (plait.chat_template, as ``transformers``' ``apply_chat_template(messages, tokenize=False)``), and the
characters of the rendered text the loss is on: the assistant's messages (by default) or all of it.

A template with ``{% generation %}`` blocks says itself which characters the assistant writes: the loss is on
them (transformers' ``return_assistant_tokens_mask``, TRL's ``assistant_only_loss``). In a template without them,
the assistant's part of message ``i`` is what rendering ``messages[:i + 1]`` adds to ``messages[:i]`` rendered
with the generation prompt: its content and the template's end of turn, not the role header that the prompt
already holds (the prefix method of Hugging Face TRL's and OpenRLHF's SFT masks). A template that renders an
earlier turn differently once later ones follow (Qwen3's drops the reasoning of turns before the last user
message) leaves no such prefix: the record is refused, naming what works instead. ``split_turns`` makes each
assistant message a document of its own, the conversation up to it rendered as the model sees it when it writes
that message, the loss on that message alone; the documents of one record are held out or trained together.
``template_kwargs`` (``--chat-template-kwargs``): variables every render gets, as
``apply_chat_template(messages, **kwargs)`` (Qwen3's ``enable_thinking``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from plait.chat_kwargs import check_template_kwargs
from plait.chat_template import ChatError, ChatTemplate, generation_marks, message_problem
from plait.errors import ConfigError

LOSS_ON = ("assistant", "all")
ASSISTANT = "assistant"
Spans = list[tuple[int, int]]  # character ranges [a, b) of a document in the loss; position len(text) is its EOS


class BadChat(ValueError):
    """A record whose messages cannot be rendered: why (the caller names the file and line)."""


@dataclass(frozen=True)
class ChatSpec:
    """How ``--chat`` renders records (picklable: each worker process loads its own template)."""

    tokenizer: str  # --tokenizer: "bytes", a folder, or a tokenizer.json (its folder's template is used)
    field: str = "messages"
    loss_on: str = ASSISTANT
    template: str | None = None  # --chat-template: a file or the template's text
    split_turns: bool = False  # --split-turns: a document per assistant message, the loss on it alone
    template_kwargs: dict | None = None  # --chat-template-kwargs: template variables given to every render

    def folder(self) -> Path | None:
        p = Path(self.tokenizer)
        if self.tokenizer == "bytes" or not p.exists():
            return None
        return p if p.is_dir() else p.parent

    def load(self) -> ChatRenderer:
        if self.loss_on not in LOSS_ON:
            raise ConfigError(f"--loss-on {self.loss_on}: choose one of {', '.join(LOSS_ON)}")
        if self.split_turns and self.loss_on != ASSISTANT:
            raise ConfigError(f"--split-turns puts the loss on each document's last assistant message: with "
                              f"--loss-on {self.loss_on} leave --split-turns out")
        kwargs = check_template_kwargs(self.template_kwargs or {})
        return ChatRenderer(self, ChatTemplate(self.folder(), self.template), kwargs)


class ChatRenderer:
    """A loaded template: ``document(value)`` turns a record's messages into (text, spans in the loss);
    ``kwargs``: the template variables every render gets."""

    def __init__(self, spec: ChatSpec, chat: ChatTemplate, kwargs: dict | None = None):
        self.spec, self.chat, self.kwargs = spec, chat, kwargs or {}
        if "default" not in chat.templates:
            raise ConfigError(f"--chat: {spec.tokenizer} has chat templates {sorted(chat.templates)} and none is "
                              "the default; pass --chat-template FILE")

    @property
    def source(self) -> str:
        """Where the template comes from (the folder's file, --chat-template, or plait's own format)."""
        if self.spec.folder() is None and self.spec.template is None:
            return f"plait's <|role|> format (--tokenizer {self.spec.tokenizer} has no chat template)"
        return self.chat.source

    @property
    def method(self) -> str:
        """How the loss's characters are found (the default template's way; for the summary and meta.json)."""
        if self.spec.loss_on == "all":
            return "every token"
        if self.spec.split_turns:
            return "a document per assistant message"
        return "{% generation %} marks" if generation_marks(self.chat.templates["default"]) else "prefixes"

    def documents(self, messages: object, tools: object = None) -> list[tuple[str, Spans]]:
        """The record's documents, each (the rendered text, its character spans in the loss): one, or with
        ``split_turns`` one per assistant message; BadChat saying why it cannot be rendered. ``tools``: the
        record's function definitions, given to the template as ``apply_chat_template(tools=)``."""
        check_messages(messages, self.spec.field)
        assert isinstance(messages, list)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise BadChat(f"'tools' is {type(tools).__name__}, not a list of function definitions")
        tools = tools or None
        if self.spec.split_turns:
            turns = [self._turn(messages[:i + 1], tools) for i, m in enumerate(messages) if m["role"] == ASSISTANT]
            if not turns:
                raise BadChat(f"no assistant message in {self.spec.field}: --split-turns makes no document of it")
            return turns
        if self.spec.loss_on == "all":
            text = self._render(messages, False, tools)
            return [(text, [(0, len(text) + 1)])]
        text, marked = self._render_spans(messages, tools)
        spans = marked if marked is not None else self._prefix_spans(messages, text, tools)
        if messages[-1]["role"] == ASSISTANT:  # the EOS ends the assistant's last turn: it learns to stop
            spans = _with_eos(spans, len(text))
        return [(text, spans)]

    def _prefix_spans(self, messages: list, text: str, tools) -> Spans:
        spans: Spans = []
        for i, m in enumerate(messages):
            if m["role"] != ASSISTANT:
                continue
            before = self._render(messages[:i], True, tools) if i else ""  # opened by the assistant: all of it
            upto = self._render(messages[:i + 1], False, tools)
            if not (upto.startswith(before) and text.startswith(upto)):
                raise BadChat(f"the chat template ({self.source}) renders {self.spec.field}[{i}] or the messages "
                              "before it differently once later ones follow (as Qwen3's drops past reasoning), so "
                              "the assistant's tokens cannot be told apart: pass --split-turns (each assistant "
                              "message a document of its own, the conversation up to it), --chat-template FILE "
                              "with a template whose {% generation %} blocks enclose the assistant's text, or "
                              "--loss-on all (every token)")
            spans.append((len(before), len(upto)))
        return spans

    def _turn(self, chat: list, tools) -> tuple[str, Spans]:
        """A document ending with the assistant's message ``chat[-1]``, the loss on it and the EOS after it."""
        before = self._render(chat[:-1], True, tools) if len(chat) > 1 else ""
        text = self._render(chat, False, tools)
        if not text.startswith(before):
            raise BadChat(f"the chat template ({self.source}) renders {self.spec.field}[:{len(chat) - 1}] with the "
                          f"generation prompt otherwise than as the start of {self.spec.field}[:{len(chat)}], so "
                          f"the assistant's message {self.spec.field}[{len(chat) - 1}] cannot be told apart; pass "
                          "--loss-on all (every token)")
        return text, [(len(before), len(text) + 1)]

    def _render_spans(self, messages: list, tools) -> tuple[str, Spans | None]:
        try:
            return self.chat.render_spans(messages, tools=tools, kwargs=self.kwargs)
        except ChatError as exc:
            raise BadChat(exc.message.replace("messages[", f"{self.spec.field}[")) from None

    def _render(self, messages: list, generation: bool, tools) -> str:
        try:
            return self.chat.render(messages, add_generation_prompt=generation, tools=tools, kwargs=self.kwargs)
        except ChatError as exc:
            raise BadChat(exc.message.replace("messages[", f"{self.spec.field}[")) from None


def _with_eos(spans: Spans, end: int) -> Spans:
    """``spans`` with the EOS at position ``end`` added (joined to a span that ends there)."""
    if spans and spans[-1][1] == end:
        return [*spans[:-1], (spans[-1][0], end + 1)]
    return [*spans, (end, end + 1)]


def check_messages(messages: object, field: str) -> None:
    """BadChat naming ``field[i]`` unless ``messages`` keeps plait.chat_template.message_problem's rule (a
    non-empty list of {role, content} objects; an assistant message may carry ``tool_calls`` instead of content)."""
    problem = message_problem(messages)
    if problem is None:
        return
    if problem.index is None:
        what = {"empty": "an empty list", "null": "null"}.get(problem.kind, problem.found)
        raise BadChat(f"{field!r} is {what}, not a list of {{role, content}} messages")
    assert isinstance(messages, list)
    m = messages[problem.index]
    where = f"{field}[{problem.index}]"
    if problem.field is None:
        raise BadChat(f"{where} is a JSON {problem.found}, not a {{role, content}} object")
    if problem.field == "role" and problem.kind == "wrong_type":
        raise BadChat(f"{where}'s role is a JSON {problem.found}, not a string")
    if problem.field == "role":
        raise BadChat(f"{where} has no role (keys: {', '.join(m) or 'none'})")
    raise BadChat(f"{where} ({m['role']}) has no content")


def no_messages_hint(record: dict, text_field: str) -> str:
    """The advice for a record without ``text_field`` that holds a list of messages: prepare it with --chat."""
    for key in ("messages", "conversations", "conversation"):
        if isinstance(record.get(key), list):
            extra = "" if key == "messages" else f" --messages-field {key}"
            return f"; it holds chat messages: pass --chat{extra} to render them with the chat template"
    return ""
