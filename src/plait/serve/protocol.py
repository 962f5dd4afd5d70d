"""OpenAI-style request parsing and validation, error bodies, and the chat template of a byte-level model."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from plait.generation.decode import Sampling

DEFAULT_MAX_TOKENS = 16
UNSUPPORTED = {"n": 1, "best_of": 1, "top_p": 1, "stop": None, "echo": False, "logprobs": None,
               "suffix": None, "tools": None, "functions": None}


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Limits:
    """What the server accepts: the model's name, context and vocabulary, the max_tokens cap, the KV budget."""

    model: str
    context: int
    vocab: int
    max_tokens: int
    kv_budget: int


@dataclass
class Parsed:
    prompts: list[list[int]]
    sampling: Sampling
    stream: bool
    chat: bool


def chat_prompt(messages: list[dict]) -> str:
    """The chat template: each message as "<|role|>\\n" + content + "\\n", then "<|assistant|>\\n"."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role')}|>\n{content or ''}\n")
    return "".join(parts) + "<|assistant|>\n"


def _number(body: dict, name: str, default, kind, lo=None, hi=None):
    value = body.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ApiError(400, f"{name} must be {'a number' if kind is float else 'an integer'}, not {value!r}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ApiError(400, f"{name}={value} must be within [{lo}, {hi}]", name)
    return kind(value)


def _prompts(value, tok, vocab: int) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return [tok.encode(value)]
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        batch = [value]
    elif isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        batch = value
    else:
        raise ApiError(400, "prompt must be a string, a list of strings or a list of token ids", "prompt")
    out = []
    for p in batch:
        ids = tok.encode(p) if isinstance(p, str) else p
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ApiError(400, f"token ids must be integers in [0, {vocab})", "prompt")
        out.append(list(ids))
    return out


def parse(body, chat: bool, tok, limits: Limits) -> Parsed:
    """Validate a /v1/completions or /v1/chat/completions body; ApiError (4xx) on anything wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model != limits.model:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{limits.model}'", "model",
                       "model_not_found")
    for name, neutral in UNSUPPORTED.items():
        if body.get(name, neutral) not in (neutral, None) and not (name == "stop" and body.get(name) == []):
            raise ApiError(400, f"{name}={body.get(name)!r} is not supported by plait serve", name, "unsupported")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
        prompts = [tok.encode(chat_prompt(messages))]
    else:
        if "prompt" not in body:
            raise ApiError(400, "prompt is required", "prompt")
        prompts = _prompts(body["prompt"], tok, limits.vocab)
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, min(DEFAULT_MAX_TOKENS, limits.max_tokens), int, 0, limits.max_tokens)
    sampling = Sampling(max_new_tokens=max_tokens, temperature=_number(body, "temperature", 0.0, float, 0, 100),
                        top_k=_number(body, "top_k", 0, int, 0, limits.vocab),
                        seed=_number(body, "seed", 0, int, 0, 2**63 - 1))
    for ids in prompts:
        if not ids:
            raise ApiError(400, "the prompt is empty (at least one token is needed)", "prompt")
        if len(ids) + max_tokens > limits.context:
            raise ApiError(400, f"This model's maximum context length is {limits.context} tokens; the prompt has "
                                f"{len(ids)} tokens and max_tokens is {max_tokens}", "prompt",
                           "context_length_exceeded")
        if len(ids) + max_tokens > limits.kv_budget:
            raise ApiError(400, f"the request needs {len(ids) + max_tokens} KV cache positions; the server's budget "
                                f"is {limits.kv_budget}", "max_tokens", "kv_budget_exceeded")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    return Parsed(prompts, sampling, stream, chat)


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def choice(p: Parsed, index: int, text: str, ids: list[int], finish: str | None, delta: bool) -> dict:
    """One choice of a response (or of a streamed chunk when ``delta``); ``token_ids`` is a plait extra."""
    if not p.chat:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": ids}
    key = "delta" if delta else "message"
    msg = {"content": text} if delta else {"role": "assistant", "content": text}
    return {"index": index, key: msg, "logprobs": None, "finish_reason": finish, "token_ids": ids}


def envelope(p: Parsed, rid: str, model: str, choices: list[dict], chunk: bool) -> dict:
    kind = ("chat.completion" if p.chat else "text_completion") + (".chunk" if chunk and p.chat else "")
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}


def usage(p: Parsed, outputs: list[list[int]]) -> dict:
    n_prompt = sum(len(x) for x in p.prompts)
    n_out = sum(len(x) for x in outputs)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
