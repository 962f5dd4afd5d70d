"""OpenAI-style request parsing and validation, and error bodies."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plait.chat_template import message_problem
from plait.errors import is_integer, is_number
from plait.generation.decode import Sampling
from plait.serve.sampling import Params

if TYPE_CHECKING:
    from plait.serve.tokens import TokenizerInfo

DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20
# fields a request may carry, beside the ones parse reads; any other field gets a 400 (never silently ignored)
FIELDS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "seed", "stream", "stream_options", "stop", "stop_token_ids", "ignore_eos",
          "include_stop_str_in_output", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "logit_bias", "logprobs", "top_logprobs", "echo", "user", "return_tokens_as_token_ids", "add_special_tokens",
          "add_generation_prompt", "chat_template", "chat_template_kwargs", "tools", "documents",
          "continue_final_message"}
COMPLETION_ONLY = {"prompt", "echo"}
CHAT_ONLY = {"messages", "top_logprobs", "add_generation_prompt", "chat_template", "chat_template_kwargs", "tools",
             "documents", "continue_final_message"}
# accepted only at these values (the features they would switch on are not implemented)
NEUTRAL = {"best_of": (None, 1), "suffix": (None, ""), "functions": (None, []),
           "tool_choice": (None, "none"), "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}),
           "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
           "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0), "prompt_logprobs": (None,),
           "store": (None, False), "metadata": (None,), "service_tier": (None, "auto"), "modalities": (None, ["text"]),
           "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
           "function_call": (None, "none")}


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
    """What the server accepts: the model's name, context and vocabulary, the max_tokens cap, the KV pool size,
    and the end-of-sequence token ids of the model (none for a byte-level model)."""

    model: str
    context: int
    vocab: int
    max_tokens: int
    kv_budget: int
    eos: tuple[int, ...] = ()


@dataclass
class Parsed:
    """A validated request: its prompts, the sampling of its first choice (choice i uses seed + i), what to send."""

    prompts: list[list[int]]
    params: Params
    stream: bool
    chat: bool
    n: int = 1
    echo: bool = False
    stop: list[str] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    include_stop: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    ids_as_tokens: bool = False  # log-probability tokens as "token_id:<id>" (distinct where texts collide)

    def choices(self) -> list[tuple[list[int], Params]]:
        """(prompt, params) of every choice, in the order of their indexes: prompt by prompt, n each."""
        out = []
        for ids in self.prompts:
            for i in range(self.n):
                s = self.params.sampling
                sampling = Sampling(s.max_new_tokens, s.temperature, s.top_k, s.seed + i, s.top_p, s.min_p)
                out.append((ids, Params(**{**self.params.__dict__, "sampling": sampling})))
        return out


def _number(body: dict, name: str, default, kind, lo=None, hi=None):
    value = body.get(name, default)
    if value is None:
        value = default
    if not (is_number(value) if kind is float else is_integer(value)):  # NaN and infinities, which JSON may hold, too
        raise ApiError(400, f"{name} must be {'a number' if kind is float else 'an integer'}, not {value!r}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ApiError(400, f"{name}={value} must be within [{lo}, {hi}]", name)
    return kind(value)


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false", name)
    return value


def _ids(value, name: str, vocab: int) -> list[int]:
    if not all(is_integer(t) and 0 <= t < vocab for t in value):
        raise ApiError(400, f"{name}: token ids must be integers in [0, {vocab})", name)
    return list(value)


def _prompts(value, tokens: TokenizerInfo, vocab: int, special: bool) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return [tokens.encode(value, special)]
    if isinstance(value, list) and value and all(is_integer(t) for t in value):
        batch = [value]
    elif isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        batch = value
    else:
        raise ApiError(400, "prompt must be a string, a list of strings or a list of token ids", "prompt")
    return [tokens.encode(p, special) if isinstance(p, str) else _ids(p, "prompt", vocab) for p in batch]


def _check_fields(body: dict, chat: bool) -> None:
    for name, value in body.items():
        if name in NEUTRAL:
            if value not in NEUTRAL[name]:
                raise ApiError(400, f"{name}={value!r} is not supported by plait serve", name, "unsupported")
        elif name not in FIELDS or (chat and name in COMPLETION_ONLY) or (not chat and name in CHAT_ONLY):
            if value is not None and not (name == "echo" and value is False):
                raise ApiError(400, _unsupported(name, value, chat), name, "unsupported")


def _unsupported(name: str, value, chat: bool) -> str:
    """Why field ``name`` is refused: a field of the other endpoint says which one takes it."""
    if chat and name in COMPLETION_ONLY:
        return (f"{name} is a field of /v1/completions; /v1/chat/completions takes messages (a list of "
                "{role, content} objects)")
    if not chat and name in CHAT_ONLY:
        return f"{name} is a field of /v1/chat/completions; /v1/completions takes a prompt"
    return f"{name}={value!r} is not supported by plait serve"


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "stop must be a string or a list of strings", "stop")
    return [s for s in stop if s]


def _logit_bias(body: dict, vocab: int) -> dict[int, float]:
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise ApiError(400, "logit_bias must map token ids to numbers in [-100, 100]", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise ApiError(400, f"logit_bias: {key!r} is not a token id", "logit_bias") from None
        if not 0 <= tok < vocab or not is_number(value) or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias: {key!r}: {value!r} must be a token id in [0, {vocab}) with a bias "
                                f"in [-100, 100]", "logit_bias")
        out[tok] = float(value)
    return out


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many top tokens to report beside each token's own log-probability (None: no log-probabilities)."""
    if not chat:
        value = body.get("logprobs")
        if value is False:  # a neutral value some clients send
            return None
        return None if value is None else _number(body, "logprobs", 0, int, 0, MAX_LOGPROBS)
    top = body.get("top_logprobs")
    if not _flag(body, "logprobs"):
        if top:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return _number(body, "top_logprobs", 0, int, 0, MAX_LOGPROBS)


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(a final usage chunk, usage so far in every chunk): stream_options include_usage, continuous_usage_stats."""
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not stream:
        raise ApiError(400, "stream_options needs stream: true", "stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise ApiError(400, f"stream_options={opts!r}: only include_usage and continuous_usage_stats are supported",
                       "stream_options", "unsupported")
    return _flag(opts, "include_usage"), _flag(opts, "continuous_usage_stats")


def _sampling(body: dict, chat: bool, limits: Limits, prompt: int) -> Sampling:
    """The sampling fields; without max_tokens a completion gets 16 tokens and a chat reply all the room its
    ``prompt`` tokens leave (as vLLM)."""
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    top_k = _number(body, "top_k", 0, int, -1, limits.vocab)
    seed = body.get("seed")
    room = min(limits.context, limits.kv_budget) - prompt
    default = max(1, min(room, limits.max_tokens)) if chat else min(DEFAULT_MAX_TOKENS, limits.max_tokens)
    return Sampling(max_new_tokens=_number(body, name, default, int, 0, limits.max_tokens),
                    temperature=_number(body, "temperature", 0.0, float, 0, 100),
                    top_k=max(top_k, 0),  # -1 (vLLM's "off") as 0
                    seed=secrets.randbits(62) if seed is None else _number(body, "seed", 0, int, 0, 2**63 - 1),
                    top_p=_number(body, "top_p", 1.0, float, 1e-9, 1), min_p=_number(body, "min_p", 0.0, float, 0, 1))


def check_model(body: dict, limits: Limits) -> None:
    """A request's model must be the served one; absent or null means the served one (as vLLM)."""
    model = body.get("model")
    if model is not None and model != limits.model:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{limits.model}'", "model",
                       "model_not_found")


def _tools(body: dict) -> None:
    """Tools are rendered into the prompt only with tool_choice "none": parsed tool calls are not implemented."""
    if body.get("tools") and body.get("tool_choice") != "none":
        raise ApiError(400, f"tool_choice={body.get('tool_choice') or 'auto'!r} (tool calls parsed from the reply) "
                            "is not supported by plait serve; with tool_choice \"none\" the tools are rendered into "
                            "the prompt by the chat template and the reply comes back as text", "tool_choice",
                       "unsupported")


def check_messages(messages: object) -> None:
    """A chat's messages as OpenAI's API takes them (plait.chat_template.message_problem's rule); ApiError 400
    naming the field (``messages[i].content``) in OpenAI's words and codes."""
    problem = message_problem(messages)
    if problem is None:
        return
    if problem.index is None:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    where = f"messages[{problem.index}]"
    if problem.field is None:
        raise ApiError(400, f"Invalid type for '{where}': expected an object with role and content, but got "
                            f"{problem.found} instead.", where, "invalid_type")
    where = f"{where}.{problem.field}"
    if problem.kind == "missing":
        raise ApiError(400, f"Missing required parameter: '{where}'.", where, "missing_required_parameter")
    found = "null" if problem.kind == "null" else problem.found
    why = " (only an assistant message with tool_calls may have null content)" if problem.field == "content" else ""
    raise ApiError(400, f"Invalid type for '{where}': expected a string, but got {found} instead{why}.", where,
                   "invalid_type")


def parse(body, chat: bool, tokens: TokenizerInfo, limits: Limits) -> Parsed:
    """Validate a /v1/completions or /v1/chat/completions body; ApiError (4xx) on anything wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_model(body, limits)
    _check_fields(body, chat)
    if chat:
        _tools(body)
        check_messages(body.get("messages"))
        prompts = [tokens.chat_ids(body)]
    else:
        if "prompt" not in body:
            raise ApiError(400, "prompt is required", "prompt")
        prompts = _prompts(body["prompt"], tokens, limits.vocab, _flag(body, "add_special_tokens", True))
    sampling = _sampling(body, chat, limits, max(len(ids) for ids in prompts))
    n = _number(body, "n", 1, int, 1, 128)
    echo = not chat and _flag(body, "echo")
    top = _logprobs(body, chat)
    stop_ids = frozenset(_ids(body.get("stop_token_ids") or [], "stop_token_ids", limits.vocab))
    eos = () if _flag(body, "ignore_eos") else limits.eos
    params = Params(sampling, presence_penalty=_number(body, "presence_penalty", 0.0, float, -2, 2),
                    frequency_penalty=_number(body, "frequency_penalty", 0.0, float, -2, 2),
                    repetition_penalty=_number(body, "repetition_penalty", 1.0, float, 1e-3, 100),
                    logit_bias=_logit_bias(body, limits.vocab), min_tokens=_number(body, "min_tokens", 0, int, 0),
                    banned=tuple(sorted(stop_ids | set(eos))), logprobs=top,
                    prompt_logprobs=top if echo and top is not None else None)
    if params.min_tokens > sampling.max_new_tokens:
        raise ApiError(400, f"min_tokens={params.min_tokens} exceeds max_tokens={sampling.max_new_tokens}",
                       "min_tokens")
    for ids in prompts:
        _check_length(ids, sampling.max_new_tokens, limits, _asked_max_tokens(body, chat), chat)
    stream = _flag(body, "stream")
    include_usage, continuous_usage = _stream_options(body, stream)
    return Parsed(prompts, params, stream, chat, n=n, echo=echo, stop=_stop(body), stop_ids=stop_ids | set(eos),
                  include_stop=_flag(body, "include_stop_str_in_output"),
                  include_usage=include_usage, continuous_usage=continuous_usage,
                  ids_as_tokens=_flag(body, "return_tokens_as_token_ids"))


def _asked_max_tokens(body: dict, chat: bool) -> bool:
    """Whether the request set its max_tokens (or, in a chat, max_completion_tokens)."""
    return body.get("max_tokens") is not None or (chat and body.get("max_completion_tokens") is not None)


def _check_length(ids: list[int], max_tokens: int, limits: Limits, asked: bool = True, chat: bool = False) -> None:
    """The prompt and its ``max_tokens`` fit the context and the KV pool; ``asked``: the request set max_tokens
    (else the message says it did not: a chat's default is the room its prompt leaves, a completion's 16)."""
    if not ids:
        raise ApiError(400, "the prompt is empty (at least one token is needed)", "prompt")
    if len(ids) + max_tokens > limits.context:
        why = (f" and max_tokens is {max_tokens}" if asked else ", which leaves no room for a reply" if chat else
               f" and max_tokens is {max_tokens} (the default of a request that does not set it)")
        raise ApiError(400, f"This model's maximum context length is {limits.context} tokens; the prompt has "
                            f"{len(ids)} tokens{why}", "prompt", "context_length_exceeded")
    if len(ids) + max_tokens > limits.kv_budget:
        raise ApiError(400, f"the request needs {len(ids) + max_tokens} KV cache positions; the server holds "
                            f"{limits.kv_budget}", "max_tokens", "kv_budget_exceeded")
