"""``plait export``: a plait checkpoint, saved under any layout, as a Hugging Face folder of its model's family."""

from __future__ import annotations

import json
from typing import Annotated

import typer

HELP = """Write a Hugging Face folder (config.json + model.safetensors, and the tokenizer files of the folder the
run was trained from) of the model's family from a plait checkpoint saved under any layout. transformers'
AutoModelForCausalLM.from_pretrained(OUT) reads it, as do plait generate --model OUT and plait serve --model OUT.

The weights are written in --dtype, and config.json's torch_dtype says so: by default the dtype the run trained
in (bfloat16 for plait train --precision bf16, float32 for fp32), half the size of float32 for a bf16 run. A
checkpoint holds float32 weights either way, so --dtype float32 exports them exactly.

OUT is a new or empty folder, or one plait export wrote before: that export is replaced, its files that this one
does not write (a tokenizer.json of another model) removed, and files of yours (a README.md) left. Any other
folder (., a model you downloaded, one holding other files) is refused unless --force, which replaces its model
as an earlier export's: its config.json, weights and tokenizer files are removed first (so none of its token ids,
tokenizer or generation settings is read with these weights), its other files left.

\b
Examples:
  # the latest checkpoint of the folder:
  plait train --steps 20 && plait export plait-checkpoints hf-tiny
  # one checkpoint:
  plait export plait-checkpoints/step_00000020 hf-tiny-20
  # exact float32 weights of a bf16 run:
  plait export plait-checkpoints hf-tiny-fp32 --dtype float32
  # again, a later step: replaces hf-tiny:
  plait export plait-checkpoints hf-tiny
  # into a git clone with a README.md:
  plait export plait-checkpoints my-hub-repo --force
  # the exported folder, as any Hugging Face folder:
  plait generate --model hf-tiny --prompt "def "
"""


def register(app: typer.Typer) -> None:
    app.command("export", help=HELP, short_help="Write a checkpoint as a Hugging Face folder.")(export_command)


def export_command(
    checkpoint: Annotated[str, typer.Argument(help="A plait checkpoint folder (or its parent).")],
    out: Annotated[str, typer.Argument(help="The Hugging Face folder to write.")],
    dtype: Annotated[str | None, typer.Option(help="The weights' dtype: float32, bfloat16 or float16 [default: the "
                                                   "dtype the run trained in: bfloat16 for --precision bf16, else "
                                                   "float32].", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Write into OUT even though it holds files that no plait "
                                        "export wrote: its config.json, model.safetensors and tokenizer files are "
                                        "removed first (and said), its other files stay.")] = False,
) -> None:
    from pathlib import Path

    from plait.checkpoint import export_pretrained, find_checkpoint
    from plait.checkpoint.export_out import check_export_out, previous_export
    from plait.errors import ConfigError

    source = find_checkpoint(checkpoint)  # which checkpoint of a --checkpoint-dir: its latest complete one
    if source is not None:  # the read and write take a while for a large model
        typer.echo(f"exporting {source} ...")
    try:
        earlier = bool(previous_export(Path(out)))  # an earlier export's folder, or (forced) another model's
        previous = check_export_out(Path(out), force)
        path = export_pretrained(checkpoint, out, dtype, force)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except OSError as exc:  # OUT is a file, or its parent cannot be made or written
        typer.echo(f"error: OUT {out}: cannot write a folder there ({exc.strerror or exc}: {exc.filename})", err=True)
        raise typer.Exit(2) from None
    from plait.tokenizers import TOKENIZER_FILES

    files = ["config.json", "model.safetensors"] + [f for f in TOKENIZER_FILES if (path / f).is_file()]
    written = json.loads((path / "config.json").read_text())["torch_dtype"]
    typer.echo(f"wrote {path}/: {', '.join(files)} ({written} weights)")
    stale = [name for name in previous if not (path / name).is_file()]
    if earlier and stale:
        typer.echo(f"removed {', '.join(stale)}: the previous export's, which this model does not have")
    elif previous and not earlier:  # forced into another model's folder: its files gone before these were written
        typer.echo(f"removed {', '.join(previous)} before writing: the model {out} held (--force)"
                   + (f"; this one has no {', '.join(stale)}" if stale else ""))
