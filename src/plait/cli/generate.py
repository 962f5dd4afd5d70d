"""``plait generate``: KV-cache decoding under TP x PP."""

from __future__ import annotations

from typing import Annotated

import typer

HELP = """Generate text from a plait checkpoint or a Hugging Face model folder with a KV cache.

Greedy by default (--temperature 0); --temperature T samples, --top-k K keeps the K best tokens. With
--tp/--pp > 1 the model is split over that many local processes (elastic launcher): each rank reads only its
own slices of the weights and keeps the KV cache of its own layers; the tokens equal one device's. The model runs
on the GPU where there is one (one process: GPU 0), in float32 unless --dtype says otherwise. A rank that
stops answering (stopped, hung) ends the job once a peer has waited the environment's PLAIT_TIMEOUT seconds
(default 300) for it, naming both ranks and what was awaited. A continuation ends at the model's
end-of-sequence token (eos_token_id in its folder's generation_config.json or config.json, as transformers'
generate stops; a checkpoint trained from a folder reads that folder's), at the first --stop string its text
holds (cut before it: --stop $'\\n\\n' ends at a blank line, as a stop string of plait serve's API), or after
--max-new-tokens.

Chat: --chat TEXT (repeatable: one conversation each, opened by --system's message when given) or
--messages FILE (a JSON list of {"role", "content"} messages, as OpenAI's API takes them) renders each
conversation through the model's own chat template (its folder's tokenizer_config.json chat_template or
chat_template.jinja, as transformers' apply_chat_template; for a checkpoint, the folder it was trained from),
exactly as plait serve renders a /v1/chat/completions request, and prints only the reply. A folder without a
template gets plait's "<|role|>" format (what plait data prepare --chat trains on there); the template used
is named on stderr. --chat-template FILE and --chat-template-kwargs JSON as for plait serve.

\b
Examples:
  plait generate --model plait-checkpoints --prompt "def " --prompt "class "
  plait generate --model path/to/hf-qwen --chat "What is 2 + 2?" \\
      --system "Answer briefly."
  plait generate --model path/to/hf-qwen3 --messages chat.json \\
      --chat-template-kwargs '{"enable_thinking": false}'
  plait generate --model plait-checkpoints --tp 2 --pp 2 --temperature 0.8 \\
      --top-k 20 --seed 1
  plait generate --model path/to/hf-llama --max-new-tokens 50 --dtype bfloat16
  plait generate --prompt "def " --stop $'\\n\\n' --stop "return"
"""

Opt = typer.Option
TARGET = "plait.generation.job:generate_job"  # the entry of each worker


def register(app: typer.Typer) -> None:
    from plait.cli.options import dataclass_options, with_options
    from plait.parallel_config import ParallelConfig

    layout = with_options(dataclass_options(ParallelConfig, only=("tp", "pp")), into="layout")
    app.command("generate", help=HELP,
                short_help="Generate text from a checkpoint or a model folder.")(layout(generate_command))


DEFAULT_PROMPT = "def "  # what a model trained on plait train's default data (Python sources) continues


def generate_command(
    ctx: typer.Context,
    model: Annotated[str, Opt(help="A plait checkpoint folder (or its parent) or a Hugging Face folder (llama, "
                                   "mistral, qwen2, qwen3, mixtral, qwen3_moe).")] = "plait-checkpoints",
    prompt: Annotated[list[str] | None, Opt(help=f"A prompt (repeatable: one batch; default, without --chat or "
                                                 f"--messages: {DEFAULT_PROMPT!r}).")] = None,
    chat: Annotated[list[str] | None, Opt(help="A user message to answer through the model's chat template "
                                              "(repeatable: one conversation each).", metavar="TEXT")] = None,
    system: Annotated[str | None, Opt(help="A system message opening each --chat conversation.",
                                      metavar="TEXT")] = None,
    messages: Annotated[list[str] | None, Opt(help="A JSON file of one conversation's messages (repeatable).",
                                              metavar="FILE")] = None,
    chat_template: Annotated[str | None, Opt(help="A Jinja chat template (file or text) in place of the "
                                                  "model's.")] = None,
    chat_template_kwargs: Annotated[str | None, Opt(help="Template variables as a JSON object, e.g. "
                                                         "'{\"enable_thinking\": false}'.")] = None,
    max_new_tokens: Annotated[int, Opt(help="Most tokens to add to each prompt (fewer where it ends at EOS).")] = 120,
    temperature: Annotated[float, Opt(help="0: greedy; otherwise sample from softmax(logits / T).")] = 0.0,
    top_k: Annotated[int, Opt(help="Sample only among the K most likely tokens (0: all).")] = 0,
    seed: Annotated[int, Opt(help="Seed of the sampler.")] = 0,
    stop: Annotated[list[str] | None, Opt(help="End a continuation at this text, cut before it (repeatable: the "
                                               "first found ends it).", metavar="TEXT")] = None,
    dtype: Annotated[str, Opt(help="The weights' and activations' dtype: float32, bfloat16 or float16 (half the "
                                   "memory, and a GPU's fast kernels; a token may then differ from float32's where "
                                   "two logits are close).")] = "float32",
    layout: dict | None = None,
) -> None:
    """``layout``: the generated --tp and --pp options (plait.cli.options)."""
    from plait.cli.progress import loading, starting
    from plait.distributed import fork_server

    tp, pp = (layout or {}).get("tp", 1), (layout or {}).get("pp", 1)
    starting("generate", tp * pp, f"tp {tp} x pp {pp}")
    # the workers' fork server imports torch and the model's modules while this process checks the request
    with fork_server.launching(TARGET, tp * pp):
        from torch.distributed.elastic.multiprocessing.api import SignalException

        from plait.cli.generate_chat import chat_prompt_ids, conversations, short
        from plait.cli.torchrun import lost_peer_in_one_line
        from plait.distributed.launch import JobError, run_or_launch
        from plait.errors import ConfigError, flag_message
        from plait.generation.decode import Sampling
        from plait.generation.job import check_layout, check_weights, dtype_named, source_config, weights_size
        from plait.parallel_config import ParallelConfig
        from plait.tokenizers import check_fits

        try:
            par = ParallelConfig(**(layout or {}))
            Sampling(max_new_tokens, temperature, top_k, seed).check()  # fail on these before launching anything
            _check_greedy(ctx, temperature, top_k)
            dtype_named(dtype)
            _check_mode(prompt, chat, messages, chat_template, chat_template_kwargs)
            if any(not s for s in stop or []):
                raise ConfigError("--stop '': an empty string would end every continuation before its first token; "
                                  "give the text to stop at (e.g. --stop $'\\n\\n' for a blank line)")
            convs = conversations(chat or [], system, messages or [])
            config, _, tok = source_config(model)
            check_fits(tok, config.vocab_size, model)  # every id a prompt's text may give has an embedding row
            check_layout(model, config, par.tp, par.pp)  # and on a bad --model or layout
            if convs:  # each conversation's ids, rendered here so that a template's error fails before launching
                ids, source = chat_prompt_ids(model, tok, config.max_seq_len, convs, chat_template,
                                              chat_template_kwargs)
                prompts = [c.label for c in convs]
                _check_prompts(prompts, [len(row) for row in ids], max_new_tokens, config.max_seq_len)
                typer.echo(f"plait generate: chat template: {source}", err=True)
            else:
                prompts, ids = prompt or [DEFAULT_PROMPT], None
                _check_prompts([f"--prompt {short(p)}" for p in prompts], [len(tok.encode(p)) for p in prompts],
                               max_new_tokens, config.max_seq_len)
            if par.tp * par.pp > 1:  # before launching (last: it reads the weights); one process checks them as it
                check_weights(model)  # loads them, before anything else, in the same words
            loading("generate", *weights_size(model))
            payload = {"model": model, "prompts": prompts, "prompt_ids": ids, "max_new_tokens": max_new_tokens,
                       "temperature": temperature, "top_k": top_k, "seed": seed, "stop": stop or [], "tp": par.tp,
                       "pp": par.pp, "dtype": dtype}
            with lost_peer_in_one_line():  # under torchrun this process is a rank
                run_or_launch(TARGET, payload, par.tp * par.pp)
        except ConfigError as exc:
            typer.echo(f"error: {flag_message(exc)}", err=True)
            raise typer.Exit(2) from None
        except JobError as exc:
            typer.echo(f"error: {exc.message}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except (KeyboardInterrupt, SignalException) as exc:  # Ctrl-C: here (one process) or to the launcher
            name = exc.sigval.name if isinstance(exc, SignalException) else "SIGINT"
            typer.echo(f"plait generate: stopped ({name})", err=True)
            raise typer.Exit(128 + int(getattr(exc, "sigval", 2))) from None


def _check_greedy(ctx: typer.Context, temperature: float, top_k: int) -> None:
    """ConfigError naming --top-k or --seed given with greedy decoding (--temperature 0), which reads neither."""
    from plait.cli.options import typed
    from plait.errors import ConfigError

    given = [f"--top-k {top_k}"] if top_k else []
    given += [f"--seed {ctx.params['seed']}"] if typed(ctx, "seed") else []
    if temperature == 0 and given:
        raise ConfigError(f"{', '.join(given)}: greedy decoding (--temperature 0, the default) always takes the most "
                          f"likely token, so {'it has' if len(given) == 1 else 'they have'} no effect; add "
                          "--temperature T (e.g. 0.8) to sample")


def _check_mode(prompt, chat, messages, chat_template, chat_template_kwargs) -> None:
    """ConfigError when --prompt is given with a conversation (--chat, --messages), or a template option
    without one (nothing would read it)."""
    from plait.errors import ConfigError

    if prompt and (chat or messages):
        raise ConfigError(f"--prompt and --{'chat' if chat else 'messages'}: a prompt is continued as raw text, a "
                          "conversation answered through the chat template; give one kind per run")
    unread = [f for f, v in (("--chat-template", chat_template), ("--chat-template-kwargs", chat_template_kwargs))
              if v is not None]
    if unread and not (chat or messages):
        raise ConfigError(f"{', '.join(unread)}: read only for a conversation; add --chat TEXT or --messages FILE")


def _check_prompts(labels: list[str], lengths: list[int], max_new_tokens: int, max_seq_len: int) -> None:
    """ConfigError naming a prompt (--prompt TEXT, or the --chat / --messages whose rendered conversation it is)
    of no tokens, or of so many that with --max-new-tokens it outgrows the model's context."""
    from plait.errors import ConfigError

    for label, n in zip(labels, lengths, strict=True):
        if not n:
            raise ConfigError(f"{label}: no tokens (the model continues a prompt of at least one); give some text")
        if n + max_new_tokens > max_seq_len:
            raise ConfigError(f"--max-new-tokens {max_new_tokens}: {label} is {n} tokens, and {n} + "
                              f"{max_new_tokens} exceeds the model's {max_seq_len} positions; give at most "
                              f"--max-new-tokens {max(0, max_seq_len - n)}")

