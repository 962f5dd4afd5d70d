"""Load a model for generation (plait checkpoint or Hugging Face folder) under a layout, and the worker job."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from plait.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

    from plait.checkpoint.store import CheckpointReader
    from plait.distributed.context import ParallelContext
    from plait.models.hf import HFWeights
    from plait.models.llama import LlamaConfig
    from plait.parallel_model import ParallelModel
    from plait.tokenizers import ByteTokenizer, FileTokenizer


def source_config(source: str) -> tuple[LlamaConfig, Callable[[], HFWeights | CheckpointReader],
                                       ByteTokenizer | FileTokenizer]:
    """(model config of its family, reader factory, tokenizer) of a checkpoint folder or a Hugging Face folder."""
    from plait.checkpoint import CheckpointReader, find_checkpoint, model_config
    from plait.models.hf import HFWeights
    from plait.tokenizers import tokenizer_for, trained_tokenizer

    path = Path(source)
    if not path.exists():
        raise ConfigError(f"--model {source}: no such folder")
    if (path / "config.json").is_file():
        weights = HFWeights(path)
        weights.check_shapes()
        return weights.config, lambda: weights, tokenizer_for(source)
    ckpt = find_checkpoint(path)
    if ckpt is None:
        raise ConfigError(f"--model {source}: neither a plait checkpoint nor a Hugging Face folder (config.json)")
    reader = CheckpointReader(ckpt)
    _, tok = trained_tokenizer(reader.meta, ckpt)
    return model_config(reader.meta), lambda: CheckpointReader(ckpt), tok


def check_weights(source: str) -> None:
    """Before launching: every shard file the plait checkpoint ``source`` lists is there and its header readable
    (CheckpointReader.check_files), so that a missing or cut file is refused, naming it, before any process starts.
    The tensors' checksums are checked by each rank as it loads its part (the whole model read here first would
    double what a large model's load reads); a Hugging Face folder's headers were read by source_config."""
    from plait.checkpoint import CheckpointReader, find_checkpoint

    path = Path(source)
    ckpt = None if (path / "config.json").is_file() else find_checkpoint(path)
    if ckpt is not None:
        CheckpointReader(ckpt).check_files(optimizer=False, data=False)


def weights_size(source: str) -> tuple[str, int]:
    """The folder whose weights ``--model source`` loads and their bytes: a Hugging Face folder's *.safetensors,
    a plait checkpoint's model tensors (its optimizer state is not read)."""
    from plait.checkpoint import CheckpointReader, find_checkpoint
    from plait.checkpoint.writer import tensor_bytes

    path = Path(source)
    ckpt = None if (path / "config.json").is_file() else find_checkpoint(path)
    if ckpt is None:
        return source, sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return str(ckpt), tensor_bytes(CheckpointReader(ckpt).meta["tensors"], optimizer=False)


def check_layout(source: str, config: LlamaConfig, tp: int, pp: int) -> None:
    """ConfigError naming --tp or --pp when the model of ``source`` cannot be split so (before any launch)."""
    from plait.models.registry import family_of_config

    try:
        family_of_config(config).check_tp(config, tp)
    except ConfigError as exc:
        raise ConfigError(f"--tp {tp} does not fit --model {source}: {exc}") from None
    if pp > config.n_layers:
        raise ConfigError(f"--pp {pp}: --model {source} has {config.n_layers} layers, one stage needs at least one; "
                          f"valid --pp: 1 to {config.n_layers}")


def tokenizer_folder(source: str) -> str:
    """The folder whose tokenizer files (special tokens, chat template, end-of-sequence ids) go with the model
    of ``source``: a Hugging Face folder itself; a plait checkpoint's, the folder it was trained from
    (plait.tokenizers.trained_tokenizer: an error when its tokenizer.json is gone); else ``source``."""
    from plait.checkpoint import CheckpointReader, find_checkpoint
    from plait.tokenizers import trained_tokenizer

    path = Path(source)
    if (path / "config.json").is_file():
        return source
    ckpt = find_checkpoint(path) if path.is_dir() else None
    folder = trained_tokenizer(CheckpointReader(ckpt).meta, ckpt)[0] if ckpt is not None else None
    return str(folder) if folder is not None else source


def dtype_named(name: str) -> torch.dtype:
    """The dtype ``--dtype name`` of plait generate or plait serve asks for (one plait export writes in); a
    ConfigError naming --dtype and the choices for any other name."""
    from plait.checkpoint.store import EXPORT_DTYPES

    if name not in EXPORT_DTYPES:
        *first, last = EXPORT_DTYPES
        raise ConfigError(f"--dtype {name}: choose {', '.join(first)} or {last}")
    return EXPORT_DTYPES[name]


def load_model(source: str, tp: int = 1, pp: int = 1, ctx: ParallelContext | None = None,
               dtype: torch.dtype = torch.float32
               ) -> tuple[nn.Module | ParallelModel, ByteTokenizer | FileTokenizer, LlamaConfig]:
    """A plain model (tp = pp = 1, no process group) on this process's device (its GPU where there is one) or a
    ParallelModel whose ranks read only their slices; its weights in ``dtype`` whatever the files hold."""
    import plait
    from plait.checkpoint.shards import load_local
    from plait.distributed.default_group import process_device
    from plait.models.registry import family_of_config

    cfg, reader, tok = source_config(source)
    build = family_of_config(cfg).model_class
    torch.manual_seed(0)
    if tp * pp == 1 and ctx is None:
        with torch.device(process_device()):  # the weights read below are copied to it
            model = build(cfg).to(dtype)
        r = reader()
        model.load_state_dict({k: r.read(k) for k in model.state_dict()})
        return model.eval(), tok, cfg
    with torch.device("meta"):  # every weight is read below: each rank allocates only its own shards
        model = build(cfg).to(dtype)
    ctx = ctx or plait.init(tp, pp, 1)
    pm = plait.parallelize(model, ctx, microbatches=1)
    load_local(pm, reader().read)
    return pm, tok, cfg


def end_ids(source: str) -> tuple[int, ...]:
    """Where a continuation of the model of ``source`` ends (stop_ids): for a plait checkpoint, the folder it was
    trained from and its data's end-of-document token, which the checkpoint records."""
    from plait.checkpoint import CheckpointReader, find_checkpoint

    path = Path(source)
    ckpt = find_checkpoint(path) if path.is_dir() and not (path / "config.json").is_file() else None
    data_eos = (CheckpointReader(ckpt).meta.get("tokenizer") or {}).get("eos") if ckpt is not None else None
    return stop_ids(tokenizer_folder(source), data_eos)


def stop_ids(folder: str | Path | None, data_eos: int | None) -> tuple[int, ...]:
    """Where a continuation of a model ends: the end-of-sequence ids its tokenizer ``folder`` names
    (plait.tokenizers.eos_ids; none without a folder) and ``data_eos``, the end-of-document token of the data
    plait trained it on (a byte-level model's has no folder to name it). ``plait generate`` and ``plait serve``
    stop there (end_ids), and so does the sample at the end of ``plait train``."""
    from plait.tokenizers import eos_ids

    ids = list(eos_ids(folder)) if folder is not None else []
    return tuple(ids + ([int(data_eos)] if data_eos is not None and int(data_eos) not in ids else []))


def generate_job(payload: dict) -> list[str]:
    """Worker entry of ``plait generate``: every rank decodes; rank 0 prints. ``prompt_ids`` (when not None):
    each prompt's ids as rendered from a conversation (``plait generate --chat``), whose reply alone is shown."""
    from plait.generation import generate
    from plait.generation.text import before_stop
    from plait.tokenizers import continuation

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if payload["tp"] * payload["pp"] != world:
        raise ConfigError(f"--tp {payload['tp']} x --pp {payload['pp']} must equal the world size {world}")
    dtype = dtype_named(payload.get("dtype", "float32"))
    model, tok, cfg = load_model(payload["model"], payload["tp"], payload["pp"], dtype=dtype)
    stop = end_ids(payload["model"])  # each continuation ends there, as transformers' generate's does
    chat = payload.get("prompt_ids") is not None
    prompts = payload["prompt_ids"] if chat else [tok.encode(p) for p in payload["prompts"]]
    strings = payload.get("stop") or []
    ids = cast(list[list[int]], generate(model, prompts, max_new_tokens=payload["max_new_tokens"],
                                         temperature=payload["temperature"], top_k=payload["top_k"],
                                         seed=payload["seed"], tokenizer=tok, stop_ids=stop, stop=strings))
    # id lists give id lists, each cut before its stop token (or after the token that completed a stop string)
    out = [before_stop(continuation(tok, p, row), strings) for p, row in zip(prompts, ids, strict=True)]
    if int(os.environ.get("RANK", "0")) == 0:
        show([""] * len(out) if chat else payload["prompts"], out)
        for label, row, text in zip(payload["prompts"], ids, out, strict=True):
            which = label if chat else f"--prompt {label!r}"
            if not row:  # a blank line alone would leave the reader guessing
                print(f"plait generate: {which}: nothing generated: the model's first token was its end-of-sequence "
                      f"token (id {' or '.join(map(str, stop))})", file=sys.stderr)
            elif not text and strings:
                print(f"plait generate: {which}: nothing generated: the continuation began with a --stop string",
                      file=sys.stderr)
    return out


def show(prompts: list[str], outputs: list[str]) -> None:
    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False)
    for p, o in zip(prompts, outputs, strict=True):
        text = Text(p, style="bold")
        text.append(o)
        console.print(text)
        console.print()
