"""``plait generate``'s chat mode: conversations (--chat, --system, --messages) turned into prompt ids through the
model's chat template, by the code that renders ``plait serve``'s /v1/chat/completions requests
(plait.serve.tokens.model_tokens), so that one conversation gets the same prompt from both."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from plait.errors import ConfigError


@dataclass(frozen=True)
class Conversation:
    """One chat to answer: ``label`` names it in errors (the flag and its value), ``messages`` as OpenAI's API
    takes them (a list of {"role", "content"} objects)."""

    label: str
    messages: list[dict]


def conversations(chat: list[str], system: str | None, files: list[str]) -> list[Conversation]:
    """One conversation per --chat (a user message, after --system's message when given) and per --messages
    FILE (a JSON list of messages); ConfigError naming the flag when a file cannot be read or breaks the
    message rule serving applies (plait.serve.protocol.check_messages)."""
    from plait.serve.protocol import ApiError, check_messages

    if system is not None and not chat:
        raise ConfigError(f"--system {short(system)}: it opens each --chat conversation, and none is given; add "
                          "--chat TEXT, or put the system message into the --messages file")
    head = [{"role": "system", "content": system}] if system is not None else []
    out = [Conversation(f"--chat {short(text)}", [*head, {"role": "user", "content": text}]) for text in chat]
    for name in files:
        try:
            messages = json.loads(Path(name).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"--messages {name}: cannot read it ({exc.strerror or exc})") from None
        except ValueError as exc:
            raise ConfigError(f"--messages {name}: not JSON ({exc}); give a JSON list of messages such as "
                              '[{"role": "user", "content": "Hello"}]') from None
        try:
            check_messages(messages)
        except ApiError as exc:
            raise ConfigError(f"--messages {name}: {exc.message}") from None
        out.append(Conversation(f"--messages {name}", messages))
    return out


def chat_prompt_ids(model: str, tok, context: int, convs: list[Conversation], template: str | None,
                    template_kwargs: str | None) -> tuple[list[list[int]], str]:
    """The prompt ids of each conversation, with the generation prompt, and where the template came from
    (the model's folder, --chat-template, or plait's own format for a folder without one, as plait serve)."""
    from plait.chat_template import check_template
    from plait.generation.job import tokenizer_folder
    from plait.serve.protocol import ApiError
    from plait.serve.tokens import model_tokens

    check_template(tokenizer_folder(model), template)
    info = model_tokens(model, tok, context, template, template_kwargs)
    ids = []
    for conv in convs:
        try:
            ids.append(info.chat_ids({"messages": conv.messages}))
        except ApiError as exc:  # the template refused the messages (raise_exception) or failed on them
            raise ConfigError(f"{conv.label}: {exc.message} ({info.chat.source})") from None
    return ids, info.chat.source


def short(text: str) -> str:
    """``text`` quoted, cut to 40 characters (as errors name a flag's value)."""
    return repr(text if len(text) <= 40 else text[:37] + "...")
