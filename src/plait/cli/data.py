"""``plait data``: prepare text sources into memory-mapped token shards that ``plait train --data`` reads."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

DATA_HELP = """Prepare training data: tokenized, memory-mapped shards for `plait train --data`.

\b
Examples:
  plait data prepare corpus.jsonl --tokenizer bytes --out data/corpus
  plait train --data data/corpus
"""

PREPARE_HELP = """Tokenize text into a prepared dataset: token shards (uint16 when the vocabulary fits, else
uint32), a document index and meta.json, with an EOS after every document and a held-out split by document.

\b
Sources (files or folders, read recursively in sorted order, hidden ones left
out; each file once):
  .jsonl .json .ndjson   one JSON object a line, of which --text-field is read
                         (--text-field wiki.jsonl=body: that SRC's own)
  .parquet               the --text-field column (pyarrow: the 'data' extra)
  a `datasets` folder    made by Dataset.save_to_disk (the 'data' extra)
  anything else          a plain text file is one document

A record that is not JSON, has no usable --text-field or is not UTF-8 stops the prepare, named by file:line;
--skip-bad skips such records and counts them by reason. Blank records are always skipped and counted.

Chat data (--chat): each record's --messages-field (default messages), a list of {"role", "content"}, is
rendered with the --tokenizer folder's chat template exactly as transformers' apply_chat_template(messages,
tokenize=False) renders it (--chat-template FILE replaces it; a folder without one, or bytes, gets plait's
<|role|> format, as plait serve), then tokenized without added special tokens (a template's BOS stays single).
The loss is on the assistant's messages (--loss-on all: every token): the text a template's {% generation %}
blocks enclose, else what each assistant message adds to the conversation before it; the mask is stored beside
the tokens and plait train ignores the other targets. --split-turns: each assistant message its own document
(templates that drop past reasoning, as Qwen3's). --chat-template-kwargs JSON: template variables every render
gets, as apply_chat_template's keyword arguments (Qwen3 without reasoning: '{"enable_thinking": false}').

The output appears at --out only when complete. A prepare stopped (Ctrl-C, a kill, a full disk) keeps its
finished tasks in a hidden folder beside --out (.NAME.partial): the same command again resumes, keeping the
tasks whose shards are intact, and writes the same bytes an uninterrupted prepare would. Changed inputs or
options are refused, naming what changed; --restart discards the kept tasks and starts over.

\b
Examples:
  plait data prepare corpus.jsonl --tokenizer bytes --out data/corpus
  plait data prepare web/ --tokenizer ./my-model --out data/web --workers 8 \\
      --held-out 0.01 --skip-bad
  plait data prepare web/ --tokenizer ./my-model --out data/web --restart
  plait data prepare web/ wiki.jsonl books.parquet --tokenizer bytes \\
      --text-field wiki.jsonl=body --text-field books.parquet=content \\
      --out data/mix
  plait data prepare chats.jsonl --tokenizer ./my-model --chat --out data/chat
  plait data prepare chats.jsonl --tokenizer ./qwen3 --chat --split-turns \\
      --chat-template-kwargs '{"enable_thinking": false}' --out data/nothink
  plait train --data data/corpus --seq-len 256
"""

Opt = typer.Option


def prepare_command(
    sources: Annotated[list[str], typer.Argument(help="Files or folders to read.", show_default=False, metavar="SRC")],
    tokenizer: Annotated[str, Opt(help="'bytes' (UTF-8 bytes, the presets' vocabulary), a model folder holding "
                                       "tokenizer.json, or a tokenizer.json file.")],
    out: Annotated[Path, Opt(help="Folder to create (it must not exist unless --force).")],
    text_field: Annotated[list[str] | None, Opt(help="Field (JSON) or column (Parquet, datasets) holding the text: "
                                                     "FIELD for every SRC, SRC=FIELD for one SRC as given (repeat "
                                                     "it); default text.", show_default=False)] = None,
    workers: Annotated[int | None, Opt(help="Tokenizing processes (default: the cores).", min=1)] = None,
    held_out: Annotated[float, Opt(help="Share of documents, chosen by a hash of their text, held out for "
                                        "evaluation.")] = 0.005,
    eos: Annotated[str | None, Opt(help="End-of-document token: an id or a token (default: the tokenizer's EOS; "
                                        "0 for bytes).")] = None,
    skip_bad: Annotated[bool, Opt(help="Skip records without a usable text field and count them, instead of "
                                       "stopping at the first.")] = False,
    force: Annotated[bool, Opt(help="Replace --out if it is a prepared dataset (or an empty folder; any other "
                                    "folder is refused): the old one stays until the new one is complete.")] = False,
    restart: Annotated[bool, Opt("--restart", help="Discard the finished tasks a stopped prepare into --out kept, "
                                                   "and start over (without it, a prepare of the same inputs and "
                                                   "options resumes from them).")] = False,
    chat: Annotated[bool, Opt("--chat", help="Records are conversations: render --messages-field with the chat "
                                             "template and train on the assistant's tokens.")] = False,
    messages_field: Annotated[str, Opt(help="With --chat: the field (column) holding the list of messages.")
                              ] = "messages",
    loss_on: Annotated[str, Opt(help="With --chat: 'assistant' (the loss on the assistant's messages only) or "
                                     "'all' (every token).")] = "assistant",
    chat_template: Annotated[str | None, Opt(help="With --chat: a Jinja template file (or its text) instead of "
                                                  "the folder's chat template.")] = None,
    split_turns: Annotated[bool, Opt("--split-turns", help="With --chat: each assistant message its own document, "
                                     "the conversation up to it as the template renders it then, the loss on that "
                                     "message (for templates that drop past reasoning, as Qwen3's).")] = False,
    chat_template_kwargs: Annotated[str | None, Opt(help="With --chat: template variables every render gets, a "
                                                         "JSON object (as apply_chat_template's keyword "
                                                         "arguments), e.g. '{\"enable_thinking\": false}'.")
                                   ] = None,
) -> None:
    from rich.console import Console

    from plait.chat_kwargs import parse_template_kwargs
    from plait.data.chat import ChatSpec
    from plait.data.prepare import Stopped, prepare
    from plait.data.resume import kept_note
    from plait.errors import ConfigError

    try:
        if not chat:
            _chat_only(messages=messages_field != "messages", loss_on=loss_on != "assistant",
                       chat_template=chat_template is not None, split_turns=split_turns,
                       chat_template_kwargs=chat_template_kwargs is not None)
        spec = ChatSpec(tokenizer, messages_field, loss_on, chat_template, split_turns,
                        parse_template_kwargs(chat_template_kwargs)) if chat else None
        prepare(sources, tokenizer, out, text_field=text_field or "text", workers=workers, held_out=held_out, eos=eos,
                skip_bad=skip_bad, force=force, console=Console(highlight=False), chat=spec, restart=restart)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except OSError as exc:  # a full disk, a source gone meanwhile: the finished tasks are kept
        where = f" ({exc.filename})" if exc.filename else ""
        typer.echo(f"error: {exc.strerror or exc}{where}; --out {out} left as it was{kept_note(out)}", err=True)
        raise typer.Exit(1) from None
    except (KeyboardInterrupt, Stopped) as exc:  # the finished tasks are kept
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        typer.echo(f"plait data prepare: stopped ({signal.Signals(signum).name}); --out {out} left as it was"
                   f"{kept_note(out)}", err=True)
        raise typer.Exit(128 + signum) from None


def _chat_only(**given: bool) -> None:
    """ConfigError naming a --chat option given without --chat."""
    from plait.errors import ConfigError

    for name, used in given.items():
        if used:
            flag = {"messages": "--messages-field"}.get(name, "--" + name.replace("_", "-"))
            raise ConfigError(f"{flag} reads chat records: add --chat")


def register(app: typer.Typer) -> None:
    data = typer.Typer(help=DATA_HELP, short_help="Prepare training data: shards for train --data.",
                       no_args_is_help=True, rich_markup_mode=None)
    data.command("prepare", help=PREPARE_HELP, short_help="Tokenize text or chats into a prepared dataset.",
                 no_args_is_help=True)(prepare_command)
    app.add_typer(data, name="data")
