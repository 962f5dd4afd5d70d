"""The folder ``plait export`` writes into: a new or empty one, or one an earlier export wrote, which it replaces.

An export marks its ``model.safetensors`` (its metadata, ``EXPORT_MARK``) so that a later export into the same
folder knows the folder's export files are its own to remove: without that, a file the new export does not write
(a tokenizer.json, a generation_config.json of the earlier model) would stay and be read with the new weights.
Into any other folder only with ``force``, which removes the same files (and other tokenizers' files) first: the
folder's own model (a downloaded one) is replaced, not mixed with the export's.
"""

from __future__ import annotations

from pathlib import Path

from plait.errors import ConfigError

EXPORT_MARK = {"plait": "export"}  # model.safetensors' metadata in a folder plait export wrote
#: the files of tokenizers that plait does not write (sentencepiece's model, byte-pair vocabularies), which a reader
#: of a folder holding them would take as the tokenizer of the weights written beside them
OTHER_TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json")


def export_names() -> tuple[str, ...]:
    """The names of the files an export may write: config.json, the weights and the tokenizer files."""
    from plait.models.hf import WEIGHTS_NAME
    from plait.tokenizers import TOKENIZER_FILES

    return ("config.json", WEIGHTS_NAME, *TOKENIZER_FILES)


def previous_export(out: Path) -> list[str]:
    """The files an earlier plait export wrote in ``out`` (those of ``export_names`` there); [] when ``out`` is not
    such a folder (missing, empty, or its model.safetensors not marked)."""
    from safetensors import SafetensorError, safe_open

    weights = out / export_names()[1]
    try:
        with safe_open(str(weights), framework="pt") as f:
            metadata = f.metadata() or {}
    except (OSError, SafetensorError):  # none there, or not a safetensors file
        return []
    if any(metadata.get(k) != v for k, v in EXPORT_MARK.items()):
        return []
    return [name for name in export_names() if (out / name).is_file()]


def check_export_out(out: Path, force: bool) -> list[str]:
    """The files in ``out`` that an export into it removes before it writes: an earlier export's
    (``previous_export``), or with ``force`` those of any other model (the names of ``export_names`` and
    ``OTHER_TOKENIZER_FILES`` there: its config.json's token ids, its tokenizer, its generation_config.json are not
    the export's model's). ConfigError when ``out`` holds anything but such an export, unless ``force``."""
    previous = previous_export(out)
    if previous or not out.is_dir():
        return previous
    if force:
        return [name for name in (*export_names(), *OTHER_TOKENIZER_FILES) if (out / name).is_file()]
    held = sorted(p.name for p in out.iterdir())
    if held:
        shown = ", ".join(held[:5]) + (f", ... ({len(held)} entries)" if len(held) > 5 else "")
        raise ConfigError(f"OUT {out}: holds {shown}, and is not a folder plait export wrote: an export would "
                          "overwrite its config.json, model.safetensors and tokenizer files and leave the rest beside "
                          "them; choose a new or empty folder, or add --force to write into it anyway")
    return previous
