"""``plait serve``: an OpenAI-compatible HTTP server (completions, chat, streaming) over a TP x PP model."""

from __future__ import annotations

import signal
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
stderr (its id, tokens, how it ended, an error's message; --no-access-log: none). Ctrl-C or SIGTERM: new
requests get 503, running ones get --shutdown-timeout seconds to finish (a second Ctrl-C: none), then
"plait serve: stopped (SIGINT)" and exit code 0, under every layout. A worker that is alive but does not
answer (stopped, hung): once a step has waited --step-timeout seconds /health answers 503 "stalled" naming the
ranks, 5 s later the job ends naming the rank that did not answer.

Chat messages become one prompt through the model folder's own chat template (tokenizer_config.json's
chat_template or chat_template.jinja, rendered as transformers' apply_chat_template does), or through
--chat-template; a folder without one gets "<|role|>\\ncontent\\n" per message, then "<|assistant|>\\n".

--chat-template-kwargs '{"enable_thinking": false}': variables every chat's template gets (a request's
own chat_template_kwargs override them key by key; a null or "auto" there keeps the server's value, as in vLLM).

\b
Examples:
  plait serve --model plait-checkpoints --tp 2 --pp 2
  plait serve --model path/to/hf-llama --port 8001 --max-batch 32
"""

Opt = typer.Option
TARGET = "plait.serve.job:serve_job"  # the entry of each worker


def register(app: typer.Typer) -> None:
    from plait.cli.options import dataclass_options, with_options
    from plait.parallel_config import ParallelConfig
    from plait.serve.config import ServeConfig

    layout = with_options(dataclass_options(ParallelConfig, only=("tp", "pp")), into="layout")
    both = ("--chat-template-kwargs", "--default-chat-template-kwargs")  # plait data prepare's name, and vLLM's
    settings = with_options(dataclass_options(ServeConfig, flags={"chat_template_kwargs": both}), into="settings")
    app.command("serve", help=HELP,
                short_help="Serve a model over an OpenAI-compatible HTTP API.")(layout(settings(serve_command)))


def serve_command(
    ctx: typer.Context,
    api_key: Annotated[str | None, Opt(help="Require \"Authorization: Bearer KEY\" on /v1 routes (else 401; "
                                            "unset: every request is served).",
                                       envvar="PLAIT_API_KEY")] = None,
    layout: dict | None = None,
    settings: dict | None = None,
) -> None:
    """``layout``: the generated --tp and --pp options; ``settings``: ServeConfig's (plait.cli.options)."""
    from plait.cli.progress import loading, starting
    from plait.distributed import fork_server

    tp, pp = (layout or {}).get("tp", 1), (layout or {}).get("pp", 1)
    starting("serve", tp * pp, f"tp {tp} x pp {pp}")
    # the workers' fork server imports torch and the model's modules while this process checks the request
    with fork_server.launching(TARGET, tp * pp):
        from torch.distributed.elastic.multiprocessing.api import SignalException

        from plait.distributed.launch import JobError, JobStopped, run_or_launch
        from plait.errors import ConfigError, flag_message
        from plait.generation.job import check_layout, check_weights, source_config, tokenizer_folder, weights_size
        from plait.parallel_config import ParallelConfig
        from plait.serve.config import ServeConfig
        from plait.tokenizers import check_fits

        try:
            par = ParallelConfig(**(layout or {}))
            cfg = ServeConfig(**(settings or {}))
            cfg.check_batch()
            _check_unread(ctx, cfg, par.tp * par.pp)
            model_cfg, _, tok = source_config(cfg.model)  # fail on a bad --model or layout before launching anything
            check_fits(tok, model_cfg.vocab_size, cfg.model)  # every id a request's text may give has an embedding row
            check_layout(cfg.model, model_cfg, par.tp, par.pp)
            cfg = cfg.resolved(model_cfg.max_seq_len)
            from plait.chat_template import check_template
            from plait.serve.job import bind

            check_template(tokenizer_folder(cfg.model), cfg.chat_template)  # fails here, not on the first chat request
            if par.tp * par.pp > 1:  # before launching; one process checks them as it loads them, in the same words
                check_weights(cfg.model)
            bind(cfg.host, cfg.port).close()  # a busy port fails here, before any worker starts
            loading("serve", *weights_size(cfg.model))
            payload = {**cfg.payload(), "tp": par.tp, "pp": par.pp, "api_key": api_key}
            # SIGINT and SIGTERM go to the workers: rank 0 drains and stops every rank (one line, exit code 0)
            run_or_launch(TARGET, payload, par.tp * par.pp, (signal.SIGINT, signal.SIGTERM))
        except ConfigError as exc:
            typer.echo(f"error: {flag_message(exc)}", err=True)
            raise typer.Exit(2) from None
        except SignalException as exc:  # SIGHUP/SIGQUIT to the launcher: the workers were stopped with it
            typer.echo(f"plait serve: stopped ({exc.sigval.name})", err=True)
        except KeyboardInterrupt:  # Ctrl-C before the server took over the signal (one process: while loading)
            typer.echo("plait serve: stopped (SIGINT)", err=True)
        except JobStopped as exc:  # the same, to the workers of a launch (still loading)
            typer.echo(f"plait serve: stopped ({exc.signal_name})", err=True)
        except JobError as exc:
            typer.echo(f"error: {exc.message}", err=True)
            raise typer.Exit(exc.exit_code) from None


def _check_unread(ctx: typer.Context, cfg, world: int) -> None:
    """ConfigError naming an option typed that this server would not read: --step-timeout with one process
    (no other rank to wait for), --prefix-cache with --kv-reserve (reserved blocks are never shared)."""
    from plait.cli.options import typed
    from plait.errors import ConfigError

    if world == 1 and typed(ctx, "step_timeout"):
        raise ConfigError(f"--step-timeout {cfg.step_timeout:g}: one process (--tp 1 --pp 1) waits for no other "
                          "rank; leave it out, or split the model with --tp/--pp")
    if cfg.kv_reserve and cfg.prefix_cache and typed(ctx, "prefix_cache"):
        raise ConfigError("--prefix-cache: not with --kv-reserve, which reserves each sequence's own blocks up "
                          "front and shares none; drop one of them")
