"""``ServeConfig``: every ``plait serve`` setting (a field's docstring is its flag's help), checked before launch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from plait.chat_kwargs import parse_template_kwargs
from plait.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServeConfig:
    """The server's settings; ``resolved`` fills the defaults that follow from the model's context length."""

    model: str = "plait-checkpoints"
    """A plait checkpoint folder (or its parent) or a Hugging Face folder (llama, mistral, qwen2, qwen3, qwen3_moe,
    mixtral)."""
    dtype: str = "float32"
    """The weights' and activations' dtype: float32, bfloat16 or float16 (half the memory of float32, and on a GPU
    its fast matrix and attention kernels; a token may then differ from float32's where two logits are close)."""
    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0 exposes the server to the network)."""
    port: int = 8000
    """Port to listen on."""
    name: str | None = None
    """Model name clients must send (default: the folder's name)."""
    max_batch: int = 16
    """Sequences that run at once (continuous batching)."""
    max_tokens: int | None = None
    """Largest max_tokens a request may ask for (default: the context length - 1, or --kv-budget - 1 if
    smaller)."""
    kv_budget: int | None = None
    """KV cache positions of the block pool (default: max-batch x context)."""
    kv_block: int = 16
    """Positions per KV cache block."""
    kv_reserve: bool = False
    """Reserve prompt + max_tokens positions at admission (no paging, no preemption: the policy before paged KV,
    for comparison)."""
    prefix_cache: bool = True
    """Share the KV blocks of a prompt's prefix that an earlier request computed (a common system prompt is
    prefilled once)."""
    step_tokens: int = 256
    """Tokens one step may feed (chunked prefill); 0: every admitted prompt whole in one step."""
    max_queue: int = 256
    """Requests that may wait for a slot; more get HTTP 503."""
    max_body_bytes: int = 16 << 20
    """Largest request body; larger ones get HTTP 413."""
    request_timeout: float = 600.0
    """Seconds a request may run before it is cancelled (HTTP 504); 0: no limit."""
    chat_template: str | None = None
    """A Jinja chat template (a file, or the template itself) instead of the folder's."""
    chat_template_kwargs: str | None = None
    """Template variables every chat request's template gets, a JSON object (e.g. '{"enable_thinking": false}');
    a request's own chat_template_kwargs override them key by key, a null or "auto" there keeping the server's
    value (vLLM's --default-chat-template-kwargs, also accepted)."""
    trust_request_chat_template: bool = False
    """Let requests send a chat_template of their own (else 400; named templates of the folder are always
    allowed)."""
    log_level: str = "info"
    """Level of plait serve's log lines on stderr: debug, info, warning, error."""
    access_log: bool = True
    """Log one line per request: client, method, path, status; a completion's id, prompt and completion tokens,
    finish (or disconnected), time to first token; total time; an error's message. /health and /metrics at
    debug."""
    shutdown_timeout: float = 10.0
    """On Ctrl-C or SIGTERM, seconds the running requests get to finish; those left end with 503 / an error
    event."""

    step_timeout: float = 120.0
    """Seconds one engine step may wait for the other ranks (tp/pp > 1): longer, and /health answers 503
    "stalled"; 5 s later the job ends naming the rank that did not answer. A step feeds at most --step-tokens
    tokens (256 of a 70B model: 3.6e13 FLOPs, under a minute on a 1 TFLOP/s CPU); raise it for slower steps
    (--step-tokens 0: a whole batch of prompts in one step)."""

    def check_batch(self) -> None:
        """ConfigError on a batch or queue size no server can run (checked before the model is read)."""
        if self.max_batch < 1 or self.max_queue < 0:
            raise ConfigError(f"--max-batch {self.max_batch} must be >= 1 and --max-queue {self.max_queue} >= 0")

    def resolved(self, context: int) -> ServeConfig:
        """These settings for a model of ``context`` positions: the defaults filled in, every value checked
        (ConfigError naming the flag and what it may be)."""
        self.check_batch()
        kv_budget = self.max_batch * context if self.kv_budget is None else self.kv_budget
        if kv_budget < 2 or self.kv_block < 1:
            raise ConfigError(f"--kv-budget {kv_budget} must be >= 2 positions and --kv-block {self.kv_block} >= 1")
        # a request holds its prompt (1 token at least) and max_tokens positions of the pool
        max_tokens = min(context, kv_budget) - 1 if self.max_tokens is None else self.max_tokens
        if not 1 <= max_tokens < context:
            raise ConfigError(f"--max-tokens {max_tokens} must be within [1, {context - 1}] (context {context})")
        if max_tokens >= kv_budget:
            raise ConfigError(f"--max-tokens {max_tokens}: every request would need more KV cache positions than "
                              f"--kv-budget {kv_budget} holds (its prompt, 1 token at least, and max_tokens): the "
                              f"largest --max-tokens that fits is {kv_budget - 1}, or raise --kv-budget to "
                              f"{max_tokens + 1}")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: must be a TCP port within [1, 65535]")
        from plait.generation.job import dtype_named

        dtype_named(self.dtype)
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"--log-level {self.log_level}: choose debug, info, warning or error")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"--shutdown-timeout {self.shutdown_timeout} must be >= 0")
        if self.step_timeout < 2:  # an idle engine sends the other ranks an empty step every second
            raise ConfigError(f"--step-timeout {self.step_timeout} must be >= 2 seconds")
        parse_template_kwargs(self.chat_template_kwargs)
        if self.step_tokens < 0 or self.max_body_bytes < 1 or self.request_timeout < 0:
            raise ConfigError(f"--step-tokens {self.step_tokens} and --request-timeout {self.request_timeout} must "
                              f"be >= 0, --max-body-bytes {self.max_body_bytes} >= 1")
        return replace(self, max_tokens=max_tokens, kv_budget=kv_budget, log_level=self.log_level.lower())

    def payload(self) -> dict:
        """What the worker job (``plait.serve.job.serve_job``) reads: these settings, the body limit as
        ``max_body`` and the served name filled in."""
        out = asdict(self)
        out["max_body"] = out.pop("max_body_bytes")
        out["name"] = self.name or Path(self.model).resolve().name
        return out
