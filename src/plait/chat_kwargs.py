"""Template variables given on the command line, ``--chat-template-kwargs JSON``: the extra variables that
``transformers``' ``apply_chat_template(messages, **kwargs)`` passes to the template (Qwen3's
``{"enable_thinking": false}``). ``plait data prepare --chat`` gives them to every render of every record;
``plait serve`` to every chat request, a request's own ``chat_template_kwargs`` overriding them key by key (as vLLM's
``--default-chat-template-kwargs``: ``merge_template_kwargs``)."""

from __future__ import annotations

import json

from plait.chat_template import RESERVED
from plait.errors import ConfigError, json_kind

FLAG = "--chat-template-kwargs"
#: request values that leave the server's value of their variable in place (vLLM's ``merge_kwargs``)
UNSET = (None, "auto")
EXAMPLE = '\'{"enable_thinking": false}\''


def parse_template_kwargs(text: str | None, flag: str = FLAG) -> dict:
    """The JSON object ``text`` as a dict ({} for None); ConfigError naming ``flag`` when it is not JSON, not an
    object, or sets a variable the renderer sets itself."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} {text}: not JSON ({exc}); pass a JSON object such as {EXAMPLE}") from None
    return check_template_kwargs(value, flag)


def check_template_kwargs(value: object, flag: str = FLAG) -> dict:
    """``value`` (a copy) when it is an object of template variables; else ConfigError naming ``flag``: not an
    object, or one of plait.chat_template.RESERVED (the messages, tools, documents and generation prompt come
    from each record or request)."""
    if not isinstance(value, dict):
        found = json_kind(value)
        raise ConfigError(f"{flag}: {found}, not a JSON object of template variables; pass one such as {EXAMPLE}")
    reserved = sorted(set(value) & RESERVED)
    if reserved:
        raise ConfigError(f"{flag} may not set {', '.join(reserved)}: the renderer sets them from each record or "
                          f"request; pass other template variables, such as {EXAMPLE}")
    return dict(value)



def merge_template_kwargs(defaults: dict, request: dict) -> dict:
    """A chat request's template variables over the server's ``defaults``, key by key, as vLLM merges its
    ``--default-chat-template-kwargs`` (``vllm.renderers.params.merge_kwargs``): a request value in ``UNSET``
    (``null`` or ``"auto"``) keeps the server's value; without server defaults the request's are taken as sent."""
    if not defaults:
        return dict(request)
    return {**defaults, **{k: v for k, v in request.items() if v not in UNSET}}
