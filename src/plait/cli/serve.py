"""``plait serve``: an OpenAI-compatible HTTP server (completions, chat, streaming) over a TP x PP model."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

HELP = """Serve a plait checkpoint or a Hugging Face model folder over an OpenAI-compatible HTTP API.

Endpoints: POST /v1/completions and /v1/chat/completions (streaming with "stream": true), GET /v1/models,
/v1/models/{id}, /health, /metrics (Prometheus), /version, POST /tokenize, /detokenize, GET /tokenizer_info.
Requests join and leave the running batch between steps (continuous batching). The KV cache is paged:
blocks of --kv-block positions out of a pool of --kv-budget positions are taken as a sequence grows; when
none is free the sequence admitted last is preempted and recomputed later. A step feeds at most
--step-tokens tokens: every decoding sequence its next one, then prompts in chunks (chunked prefill).
With --tp/--pp > 1 the model is split over that many local processes; rank 0 also runs the HTTP server.
Greedy by default (temperature 0): the tokens equal `plait generate`'s. One log line per request on
stderr (--no-access-log: none). Ctrl-C or SIGTERM: new requests get 503, running ones get --shutdown-timeout
seconds to finish (a second Ctrl-C: none), then "plait serve: stopped (SIGINT)" and exit code 0, under every
layout.

\b
Chat messages become one prompt through the model folder's own chat template (tokenizer_config.json's
chat_template or chat_template.jinja, rendered as transformers' apply_chat_template does), or through
--chat-template; a folder without one gets "<|role|>\\ncontent\\n" per message, then "<|assistant|>\\n".

\b
Examples:
  plait serve --model plait-checkpoints --tp 2 --pp 2
  plait serve --model path/to/hf-llama --port 8001 --max-batch 32
"""

Opt = typer.Option


def register(app: typer.Typer) -> None:
    from plait.cli.options import dataclass_options, with_options
    from plait.parallel_config import ParallelConfig

    layout = with_options(dataclass_options(ParallelConfig, only=("tp", "pp")), into="layout")
    app.command("serve", help=HELP)(layout(serve_command))


def serve_command(
    model: Annotated[str, Opt(help="A plait checkpoint folder (or its parent) or a Hugging Face folder (llama, "
                                   "mistral, qwen2, qwen3, mixtral).")] = "plait-checkpoints",
    host: Annotated[str, Opt(help="Address to listen on (0.0.0.0 exposes the server to the network).")]
    = "127.0.0.1",
    port: Annotated[int, Opt(help="Port to listen on.")] = 8000,
    name: Annotated[str | None, Opt(help="Model name clients must send (default: the folder's name).")] = None,
    max_batch: Annotated[int, Opt(help="Sequences that run at once (continuous batching).")] = 16,
    max_tokens: Annotated[int | None, Opt(help="Largest max_tokens a request may ask for (default: the "
                                               "context length - 1).")] = None,
    kv_budget: Annotated[int | None, Opt(help="KV cache positions of the block pool (default: max-batch x "
                                              "context).")] = None,
    kv_block: Annotated[int, Opt(help="Positions per KV cache block.")] = 16,
    kv_reserve: Annotated[bool, Opt(help="Reserve prompt + max_tokens positions at admission (no paging, no "
                                         "preemption: the policy before paged KV, for comparison).")] = False,
    prefix_cache: Annotated[bool, Opt(help="Share the KV blocks of a prompt's prefix that an earlier request "
                                           "computed (a common system prompt is prefilled once).")] = True,
    step_tokens: Annotated[int, Opt(help="Tokens one step may feed (chunked prefill); 0: every admitted prompt "
                                         "whole in one step.")] = 256,
    max_queue: Annotated[int, Opt(help="Requests that may wait for a slot; more get HTTP 503.")] = 256,
    api_key: Annotated[str | None, Opt(help="Require \"Authorization: Bearer KEY\" on /v1 routes (else 401).",
                                       envvar="PLAIT_API_KEY")] = None,
    max_body_bytes: Annotated[int, Opt(help="Largest request body; larger ones get HTTP 413.")] = 16 << 20,
    request_timeout: Annotated[float, Opt(help="Seconds a request may run before it is cancelled (HTTP 504); "
                                               "0: no limit.")] = 600.0,
    chat_template: Annotated[str | None, Opt(help="A Jinja chat template (a file, or the template itself) "
                                                   "instead of the folder's.")] = None,
    trust_request_chat_template: Annotated[bool, Opt(help="Let requests send a chat_template of their own (else "
                                                          "400; named templates of the folder are always allowed).")]
    = False,
    log_level: Annotated[str, Opt(help="Level of plait serve's log lines on stderr: debug, info, warning, error.")]
    = "info",
    access_log: Annotated[bool, Opt(help="Log one line per request at INFO: client, method, path, status, prompt "
                                         "and completion tokens, time to first token, total time.")] = True,
    shutdown_timeout: Annotated[float, Opt(help="On Ctrl-C or SIGTERM, seconds the running requests get to "
                                                "finish; those left end with 503 / an error event.")] = 10.0,
    layout: dict | None = None,
) -> None:
    """``layout``: the generated --tp and --pp options (plait.cli.options)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from plait.distributed.launch import JobError, run_or_launch
    from plait.errors import ConfigError, flag_message, require_extra
    from plait.generation.job import source_config, tokenizer_folder
    from plait.parallel_config import ParallelConfig

    try:
        require_extra("serve", ("fastapi", "starlette", "uvicorn", "jinja2"), "plait serve")  # before any other work
        par = ParallelConfig(**(layout or {}))
        tp, pp = par.tp, par.pp
        if max_batch < 1 or max_queue < 0:
            raise ConfigError(f"--max-batch {max_batch} must be >= 1 and --max-queue {max_queue} >= 0")
        cfg, _, _ = source_config(model)  # fail on a bad --model before launching anything
        context = cfg.max_seq_len
        max_tokens = context - 1 if max_tokens is None else max_tokens
        kv_budget = max_batch * context if kv_budget is None else kv_budget
        if not 1 <= max_tokens < context:
            raise ConfigError(f"--max-tokens {max_tokens} must be within [1, {context - 1}] (context {context})")
        if kv_budget < 2 or kv_block < 1:
            raise ConfigError(f"--kv-budget {kv_budget} must be >= 2 positions and --kv-block {kv_block} >= 1")
        if log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"--log-level {log_level}: choose debug, info, warning or error")
        if shutdown_timeout < 0:
            raise ConfigError(f"--shutdown-timeout {shutdown_timeout} must be >= 0")
        if step_tokens < 0 or max_body_bytes < 1 or request_timeout < 0:
            raise ConfigError(f"--step-tokens {step_tokens} and --request-timeout {request_timeout} must be >= 0, "
                              f"--max-body-bytes {max_body_bytes} >= 1")
        from plait.serve.chat import check_template
        from plait.serve.job import bind

        check_template(tokenizer_folder(model), chat_template)  # fails here, not on the first chat request
        bind(host, port).close()  # a busy port fails here, before any worker starts
        payload = {"model": model, "tp": tp, "pp": pp, "host": host, "port": port, "max_batch": max_batch,
                   "max_tokens": max_tokens, "kv_budget": kv_budget, "max_queue": max_queue, "kv_block": kv_block,
                   "kv_reserve": kv_reserve, "prefix_cache": prefix_cache, "step_tokens": step_tokens,
                   "api_key": api_key, "chat_template": chat_template,
                   "trust_request_chat_template": trust_request_chat_template, "log_level": log_level.lower(),
                   "access_log": access_log, "shutdown_timeout": shutdown_timeout,
                   "max_body": max_body_bytes, "request_timeout": request_timeout,
                   "name": name or Path(model).resolve().name}
        # SIGINT and SIGTERM go to the workers: rank 0 drains and stops every rank (one line, exit code 0)
        run_or_launch("plait.serve.job:serve_job", payload, tp * pp, (signal.SIGINT, signal.SIGTERM))
    except ConfigError as exc:
        typer.echo(f"error: {flag_message(exc)}", err=True)
        raise typer.Exit(2) from None
    except SignalException as exc:  # SIGHUP/SIGQUIT to the launcher: the workers were stopped with it
        typer.echo(f"plait serve: stopped ({exc.sigval.name})", err=True)
    except KeyboardInterrupt:  # Ctrl-C before the server took over the signal (one process: while loading)
        typer.echo("plait serve: stopped (SIGINT)", err=True)
    except JobError as exc:
        typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(exc.exit_code) from None
