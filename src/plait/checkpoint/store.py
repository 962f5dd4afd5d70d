"""Sharded, atomic, layout-independent checkpoints: per-rank safetensors files plus one ``meta.json``.

``<dir>/step_00000100/`` holds ``pp{p}-tp{t}-dp{d}.safetensors`` (the valid part of each local tensor and of its
optimizer state, under plain-model keys) and ``meta.json`` (for every tensor: global shape, dtype and the
(file, dim, start, stop, checksums) of each shard; layout, step, optimizer hyper-parameters, scalars and updates made,
data position, RNG). Saving (``plait.checkpoint.writer``, in the step loop or in the background) writes into
``.step_*.tmp``, ``meta.json`` last, then renames it and rewrites ``latest`` atomically: a kill at any moment
leaves the previous checkpoint loadable. Loading (here) reads only the slices the new layout needs, so
tp2·pp2 loads as tp1·pp4 or as one plain model, and the ranks of a tp4 load of a tp1 checkpoint read a quarter of
it each; what a read hands back has been checked against its checksums (plait.checkpoint.checksums): the blocks it
touches, or, for a checkpoint saved with one checksum per tensor, all of the tensor on its first read. Needs a
filesystem shared by all ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plait.checkpoint.checksums import BLOCK_KEY, KEY, check_blocks, check_tensor
from plait.checkpoint.shards import copy_padded, load_local, local_tensors, param_keys
from plait.checkpoint.writer import FORMAT, LATEST, META, OPTIM, save_checkpoint, torch_optimizer
from plait.errors import ConfigError

if TYPE_CHECKING:
    from plait.models.llama import LlamaConfig
    from plait.optim import ParallelOptimizer
    from plait.parallel_model import ParallelModel

__all__ = ["EXPORT_DTYPES", "CheckpointReader", "export_pretrained", "find_checkpoint", "incomplete_checkpoints",
           "load_checkpoint", "model_config", "save_checkpoint", "trained_dtype"]


def find_checkpoint(path: str | Path) -> Path | None:
    """A checkpoint folder: ``path`` itself, the one ``latest`` names, or the newest complete ``step_*``."""
    p = Path(path)
    if (p / META).is_file():
        return p
    pointer = p / LATEST
    if pointer.is_file():
        named = p / pointer.read_text().strip()
        if (named / META).is_file():
            return named
    done = sorted(q for q in p.glob("step_*") if (q / META).is_file())
    return done[-1] if done else None


def incomplete_checkpoints(path: str | Path, found: Path | None) -> list[Path]:
    """The checkpoints of folder ``path`` that ``find_checkpoint`` passed over for ``found`` (None: it found none):
    each ``step_*`` newer than ``found`` without a ``meta.json`` (a save or a copy that did not finish), and the
    folder ``latest`` names when it is not complete (its ``meta.json`` or the folder itself missing)."""
    p = Path(path)
    if (p / META).is_file():
        return []
    passed = {q for q in p.glob("step_*") if q.is_dir() and not (q / META).is_file()}
    named = (p / LATEST).read_text().strip() if (p / LATEST).is_file() else ""
    if named and not (p / named / META).is_file():
        passed.add(p / named)
    return sorted(q for q in passed if found is None or q.name > found.name)


class CheckpointReader:
    """Reads full tensors or slices of one checkpoint (only the shard files that overlap)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_file = self.path / META
        if not meta_file.is_file():
            raise ConfigError(f"{self.path}: not a plait checkpoint (no {META})")
        try:
            self.meta = json.loads(meta_file.read_text())
        except ValueError as exc:
            raise ConfigError(f"{self.path}: {META} is not valid JSON ({exc}); the checkpoint is damaged") from None
        if self.meta.get("format") != FORMAT:
            raise ConfigError(f"{self.path}: unknown checkpoint format {self.meta.get('format')!r}")
        self._handles: dict[str, Any] = {}  # file -> an open safetensors handle
        self._checked: set[tuple[str, str]] = set()  # (file, tensor) read whole and found to match its checksum

    def _handle(self, file: str):
        from safetensors import SafetensorError, safe_open

        if file not in self._handles:
            if not (self.path / file).is_file():
                raise ConfigError(f"{self.path}: {file} is missing, though {META} lists it (a checkpoint copied in "
                                  "part?)")
            try:
                self._handles[file] = safe_open(str(self.path / file), framework="pt")
            except SafetensorError as exc:
                raise ConfigError(f"{self.path}: {file} cannot be read ({exc}); the checkpoint is damaged") from None
        return self._handles[file]

    def _piece(self, shard: dict, name: str, dim: int | None = None, start: int = 0,
               stop: int | None = None) -> torch.Tensor:
        """Indices ``start:stop`` along ``dim`` of the part of tensor ``name`` that ``shard``'s file holds (all of it
        when ``dim`` is None), its checksums checked first (plait.checkpoint.checksums): of a part with block
        checksums, the blocks the read touches (read whole: at most one more block each side); of a part with one
        checksum of its whole, all of it, on its first read."""
        file = shard["file"]
        handle = self._handle(file)
        blocks = shard.get(BLOCK_KEY)
        if blocks is not None:
            part = handle.get_slice(name)
            bdim, size = blocks["dim"], blocks["size"]
            shape = part.get_shape()
            if dim is None or not shape:  # all of it
                whole = handle.get_tensor(name)
                check_blocks(self.path, file, name, whole, 0, blocks)
                return whole
            stop = shape[dim] if stop is None else stop
            first = start // size if dim == bdim else 0  # the blocks the read touches
            lo, hi = first * size, (min(-(-stop // size) * size, shape[bdim]) if dim == bdim else shape[bdim])
            span = part[tuple([slice(None)] * bdim + [slice(lo, hi)])]
            check_blocks(self.path, file, name, span, first, blocks)
            return span.narrow(dim, start - lo if dim == bdim else start, stop - start)
        if KEY in shard and (file, name) not in self._checked:
            whole = handle.get_tensor(name)
            check_tensor(self.path, file, name, whole, shard)
            self._checked.add((file, name))
            return whole if dim is None else whole.narrow(dim, start, (stop or whole.shape[dim]) - start)
        part = handle.get_slice(name)
        if dim is None:
            return part[:]
        return part[tuple([slice(None)] * dim + [slice(start, stop)])]

    def check_files(self, optimizer: bool = True, data: bool = True) -> None:
        """ConfigError naming the first file that meta.json lists and that is missing or unreadable (its header),
        then (``data``) the first tensor whose bytes do not match their checksum, each read once (``optimizer``
        False: the optimizer state left out). Headers alone cost a few reads a file; ``data`` reads the whole
        checkpoint on this one process, which the ranks that load it also do, each its own part, as they load."""
        parts = sorted(((name, s) for name, entry in self.meta.get("tensors", {}).items() for s in entry["shards"]
                        if optimizer or not name.startswith(OPTIM)), key=lambda p: (p[1]["file"], p[0]))
        for file in sorted({s["file"] for _, s in parts}):
            self._handle(file)
        for name, shard in (parts if data else ()):  # file by file
            self._piece(shard, name)

    def has(self, key: str) -> bool:
        return key in self.meta["tensors"]

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        entry = self.meta["tensors"].get(key)
        if entry is None:
            raise ConfigError(f"{self.path}: checkpoint has no tensor {key!r}")
        shards = sorted(entry["shards"], key=lambda s: s["start"])
        if any(s["dim"] is None for s in shards):  # one file holds all of it
            return self._piece(shards[0], key, dim, start, entry["shape"][dim] if dim is not None and stop is None
                               else stop)
        sdim = shards[0]["dim"]
        if dim is None or dim != sdim:
            full = torch.cat([self._piece(s, key) for s in shards], dim=sdim)
            return full if dim is None else full.narrow(dim, start, (stop or full.shape[dim]) - start)
        stop = entry["shape"][dim] if stop is None else stop
        pieces = []
        for s in shards:
            lo, hi = max(start, s["start"]), min(stop, s["stop"])
            if lo < hi:
                pieces.append(self._piece(s, key, dim, lo - s["start"], hi - s["start"]))
        return torch.cat(pieces, dim=dim)

    def full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Every model tensor in full (optimizer state left out), each cast to ``dtype`` as it is read (None: as
        saved): for one device or a Hugging Face export."""
        return {k: self.read(k).to(dtype) if dtype is not None else self.read(k) for k in self.meta["tensors"]
                if not k.startswith(OPTIM)}


#: the dtypes of the weights ``plait export --dtype`` writes, by name
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def trained_dtype(meta: dict) -> str:
    """The name of the dtype a checkpoint's run computed in: bfloat16 for ``--precision bf16``, else float32 (a
    checkpoint saves the float32 masters of a bf16 run's weights either way)."""
    from plait.optim.precision import PRECISIONS

    dtype = PRECISIONS.get(meta.get("train", {}).get("precision", "fp32")) or torch.float32
    return str(dtype).removeprefix("torch.")


def load_checkpoint(pm: ParallelModel, optimizer: ParallelOptimizer | torch.optim.Optimizer | None,
                    path: str | Path) -> dict:
    """Load a checkpoint saved under any layout into ``pm`` (and ``optimizer``); returns its metadata."""
    reader = CheckpointReader(path)
    load_local(pm, reader.read)
    if getattr(optimizer, "keeps_masters", False):
        _load_masters(pm, optimizer, reader)
    if optimizer is not None and reader.meta["optimizer"]["param_groups"] is not None:
        _load_optimizer(pm, optimizer, reader)
    if optimizer is not None and hasattr(optimizer, "steps"):
        # the updates made, where the learning-rate schedule goes on: a step skipped as non-finite makes none; a
        # checkpoint that does not record them made one a step
        steps = reader.meta["optimizer"].get("steps")
        optimizer.steps = int(reader.meta["step"] if steps is None else steps)
    layout = reader.meta["layout"]
    same = ((layout["tp"], layout["pp"], layout["dp"], layout.get("cp", 1))
            == (pm.ctx.tp_size, pm.ctx.pp_size, pm.ctx.dp_size, pm.ctx.cp_size))
    if same and reader.meta.get("rng_rank0") is not None and pm.ctx.rank == 0:
        torch.set_rng_state(torch.tensor(reader.meta["rng_rank0"], dtype=torch.uint8))
    return reader.meta


@torch.no_grad()
def _load_masters(pm, optimizer, reader: CheckpointReader) -> None:
    """The fp32 weights of the checkpoint into a ZeRO optimizer's masters (the bf16 parameters got them cast)."""
    keys = param_keys(pm)
    values = {}
    for lt in local_tensors(pm):
        if keys.get(id(lt.tensor)) == lt.key:
            data = reader.read(lt.key, lt.dim, lt.start, lt.stop) if lt.dim is not None else reader.read(lt.key)
            values[lt.tensor] = torch.zeros(lt.tensor.shape, dtype=torch.float32, device=lt.tensor.device)
            copy_padded(values[lt.tensor], data, lt.dim)
    optimizer.load_master_weights(values)


@torch.no_grad()
def _load_optimizer(pm, optimizer, reader: CheckpointReader) -> None:
    meta = reader.meta["optimizer"]
    for group, saved in zip(torch_optimizer(optimizer).param_groups, meta["param_groups"], strict=False):
        group.update({k: v for k, v in saved.items() if k in group})
    names = sorted({k.split("/")[1] for k in reader.meta["tensors"] if k.startswith(OPTIM)})
    keys = param_keys(pm)
    loaded: dict = {}
    for lt in local_tensors(pm):
        if keys.get(id(lt.tensor)) != lt.key:
            continue
        state = {}
        for name in names:
            full = f"{OPTIM}{name}/{lt.key}"
            if reader.has(full):
                data = reader.read(full, lt.dim, lt.start, lt.stop) if lt.dim is not None else reader.read(full)
                state[name] = torch.zeros(lt.tensor.shape, dtype=data.dtype, device=lt.tensor.device)
                copy_padded(state[name], data, lt.dim)
        for name, value in meta["scalars"].get(lt.key, {}).items():
            state[name] = torch.tensor(value, dtype=torch.float32)
        if state:
            loaded[lt.tensor] = state
    if hasattr(optimizer, "load_gathered_state"):
        optimizer.load_gathered_state(loaded)  # ZeRO-1: each rank keeps its slices
    else:
        for param, state in loaded.items():
            optimizer.state[param] = state


def model_config(meta: dict) -> LlamaConfig:
    """The plain-model config a checkpoint was saved with (its family's config class; llama if unnamed)."""
    from plait.models.registry import family_for_type

    return family_for_type(meta.get("family", "llama")).config_class(**meta["model"])


def _refuse_hf_folder(checkpoint: str | Path) -> None:
    """The ConfigError for a Hugging Face folder given as the checkpoint to export: plait reads a folder of a
    supported family as --model as it is, and none of another."""
    from plait.models.hf import folder_family, read_config

    try:
        folder_family(read_config(checkpoint))
    except ConfigError as exc:  # a model_type no plait command reads (or a config.json that is no JSON object)
        raise ConfigError(f"CHECKPOINT {checkpoint}: a Hugging Face folder (config.json), not a plait checkpoint, "
                          f"and not one plait reads either: {exc}") from None
    raise ConfigError(f"CHECKPOINT {checkpoint}: a Hugging Face folder already (config.json), not a plait "
                      "checkpoint: plait train, generate and serve take it as --model as it is")


def export_pretrained(checkpoint: str | Path, out: str | Path, dtype: str | None = None, force: bool = False) -> Path:
    """Write a Hugging Face folder of the model's family from a checkpoint of any layout (one process), its weights
    and config.json's torch_dtype in ``dtype`` (a name of EXPORT_DTYPES; None: the dtype the run trained in).

    ``out`` is new, empty, or a folder an earlier export wrote, whose export files (``previous_export``) are removed
    first; any other folder is a ConfigError unless ``force``, which removes its model's files first (its config.json,
    weights and tokenizer files: ``check_export_out``) and leaves its other files."""
    from plait.checkpoint.export_out import EXPORT_MARK, check_export_out
    from plait.models.hf import check_weights_out, config_to_hf, generation_token_ids, save_state_dict_pretrained
    from plait.models.registry import folder_family_of_config
    from plait.tokenizers import copy_tokenizer_files, trained_tokenizer

    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: valid {', '.join(EXPORT_DTYPES)} (or leave it out: the dtype the run "
                          "trained in)")
    path = find_checkpoint(checkpoint)
    if path is None and (Path(checkpoint) / "config.json").is_file():
        _refuse_hf_folder(checkpoint)
    if path is None:
        raise ConfigError(f"CHECKPOINT {checkpoint}: no plait checkpoint there (a step_* folder that plait train "
                          "saved, or the --checkpoint-dir holding them)")
    reader = CheckpointReader(path)
    cfg = model_config(reader.meta)
    folder, _ = trained_tokenizer(reader.meta, path)  # the tokenizer goes with the weights
    previous = check_export_out(Path(out), force)  # an earlier export's (or forced, a model's) files: replaced
    check_weights_out(Path(out))
    family, cfg = folder_family_of_config(cfg)  # a preset trained with --experts: a Mixtral folder
    config_to_hf(cfg, family)  # its ConfigError, as the two checks above, before anything in out is removed
    weights = EXPORT_DTYPES[dtype or trained_dtype(reader.meta)]
    state = reader.full_state_dict(weights)  # read (and its checksums checked) before anything in out is removed
    for name in previous:
        (Path(out) / name).unlink()
    save_state_dict_pretrained(family, cfg, state, out, EXPORT_MARK)  # config.json's torch_dtype: theirs
    copy_tokenizer_files(folder, Path(out))
    hf = json.loads((Path(out) / "config.json").read_text())
    # Where generation stops, as before the export: the end-of-document token it was trained with; the other ids
    # (and eos without one) from the generation_config.json that came with its tokenizer.
    ids = {k: v for k, v in generation_token_ids(Path(out)).items() if hf.get(k) is None}
    eos = (reader.meta.get("tokenizer") or {}).get("eos")
    if eos is not None and hf.get("eos_token_id") is None:
        ids["eos_token_id"] = int(eos)
    if ids:
        (Path(out) / "config.json").write_text(json.dumps({**hf, **ids}, indent=2) + "\n")
    return Path(out)
