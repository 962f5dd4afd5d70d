"""Sharded, atomic, layout-independent checkpoints: per-rank safetensors files plus one ``meta.json``.

``<dir>/step_00000100/`` holds ``pp{p}-tp{t}-dp{d}.safetensors`` (the valid part of each local tensor and of its
optimizer state, under plain-model keys) and ``meta.json`` (for every tensor: global shape, dtype and the
(file, dim, start, stop) of each shard; layout, step, optimizer hyper-parameters and scalars, data
position, RNG). A save writes into ``.step_*.tmp``, fsyncs, then renames it and rewrites ``latest``
atomically: a kill at any moment leaves the previous checkpoint loadable. Loading reads only the slices
the new layout needs, so tp2·pp2 loads as tp1·pp4 or as one plain model. Needs a filesystem shared by
all ranks (rank 0 renames).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.checkpoint.shards import copy_padded, load_local, local_tensors, param_keys
from plait.errors import ConfigError

FORMAT = "plait-checkpoint/1"
META = "meta.json"
LATEST = "latest"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_optimizer(optimizer):
    """The per-parameter torch optimizer (a plait.optim.ParallelOptimizer wraps one)."""
    return getattr(optimizer, "optimizer", optimizer)


def _optimizer_states(optimizer) -> dict:
    """Optimizer state keyed by local parameter; under ZeRO-1 gathered over DP (collective on every rank)."""
    if optimizer is None:
        return {}
    if hasattr(optimizer, "gathered_state"):
        return optimizer.gathered_state()
    return dict(optimizer.state)


def _writes(ctx, lt) -> bool:
    """Whether this rank writes ``lt``: each tensor region is written by exactly one rank."""
    group = getattr(lt.tensor, "_plait_grad_group", None)
    if group is not None:  # an expert under expert parallelism: the lowest rank holding it writes it
        return ctx.rank == min(dist.get_process_group_ranks(group[0]))
    if ctx.dp_rank != 0:
        return False  # data-parallel replicas hold the same tensors
    if lt.dim is None:
        return ctx.tp_size == 1 or ctx.tp_rank == 0  # replicated over TP
    return lt.stop > lt.start  # not an all-padding shard


def _local_tensors(pm, states: dict, masters: dict) -> tuple[dict[str, torch.Tensor], list[dict], dict]:
    """This rank's tensors to write, their shard records, and optimizer scalars per key. A parameter with an
    fp32 master (ZeRO with bf16 parameters) is written as its master: checkpoints hold the exact weights."""
    ctx = pm.ctx
    tensors: dict[str, torch.Tensor] = {}
    records: list[dict] = []
    scalars: dict[str, dict[str, float]] = {}
    keys = param_keys(pm)
    for lt in local_tensors(pm):
        if not _writes(ctx, lt):
            continue
        master = masters.get(lt.tensor)
        value = lt.valid if master is None else (master if lt.dim is None else master.narrow(
            lt.dim, 0, lt.stop - lt.start))
        pairs = [(lt.key, value)]
        state = states.get(lt.tensor, {}) if keys.get(id(lt.tensor)) == lt.key else {}
        for name, value in state.items():
            if torch.is_tensor(value) and value.shape == lt.tensor.shape:
                pairs.append((f"optim/{name}/{lt.key}", value if lt.dim is None else value.narrow(
                    lt.dim, 0, lt.stop - lt.start)))
            else:
                scalars.setdefault(lt.key, {})[name] = float(value)
        for name, t in pairs:
            tensors[name] = t.detach().to("cpu", copy=True).contiguous()
            records.append({"name": name, "dim": lt.dim, "start": lt.start, "stop": lt.stop,
                            "shape": lt.full_shape, "dtype": str(t.dtype).removeprefix("torch.")})
    return tensors, records, scalars


def save_checkpoint(pm, optimizer, directory: str | Path, step: int, extra: dict | None = None,
                    keep: int = 3) -> Path:
    """Collective: every rank writes its shards; returns the final checkpoint folder."""
    from safetensors.torch import save_file

    ctx = pm.ctx
    root = Path(directory)
    final, tmp = root / f"step_{step:08d}", root / f".step_{step:08d}.tmp"
    if ctx.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    fname = f"pp{ctx.pp_rank}-tp{ctx.tp_rank}-dp{ctx.dp_rank}.safetensors"
    states = _optimizer_states(optimizer)  # collective under ZeRO: every rank takes part
    masters = optimizer.gathered_masters() if hasattr(optimizer, "gathered_masters") else {}  # collective
    with pm.full_parameters():  # ZeRO-3: every local parameter gathered for the duration (collective)
        tensors, records, scalars = _local_tensors(pm, states, masters)
    if tensors:  # data-parallel replicas write nothing (experts under EP excepted)
        save_file(tensors, str(tmp / fname), metadata={"format": FORMAT})
        _fsync_path(tmp / fname)
    parts: list = [None] * ctx.world_size
    rng = torch.get_rng_state().tolist() if ctx.rank == 0 else None
    dist.all_gather_object(parts, (fname, records, scalars))
    if ctx.rank == 0:
        meta = _meta(pm, optimizer, step, parts, extra or {}, rng)
        (tmp / META).write_text(json.dumps(meta, indent=1))
        _fsync_path(tmp / META)
        _fsync_path(tmp)
        _commit(root, tmp, final, keep)
    dist.barrier()
    return final


def _meta(pm, optimizer, step: int, parts: list, extra: dict, rng) -> dict:
    tensors: dict[str, dict] = {}
    optim_scalars: dict[str, dict] = {}
    for fname, records, scalars in parts:
        optim_scalars.update(scalars)
        for r in records:
            entry = tensors.setdefault(r["name"], {"shape": r["shape"], "dtype": r["dtype"], "shards": []})
            shard = {"file": fname, "dim": r["dim"], "start": r["start"], "stop": r["stop"]}
            if shard not in entry["shards"]:
                entry["shards"].append(shard)
    groups = None
    if optimizer is not None:
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in _torch_optimizer(optimizer).state_dict()["param_groups"]]
    ctx = pm.ctx
    return {"format": FORMAT, "step": step, "tensors": tensors, "optimizer": {
        "type": type(optimizer).__name__ if optimizer is not None else None, "param_groups": groups,
        "scalars": optim_scalars}, "layout": {"tp": ctx.tp_size, "pp": ctx.pp_size, "dp": ctx.dp_size,
        "schedule": pm.schedule.name if hasattr(pm.schedule, "name") else None}, "rng_rank0": rng, **extra}


def _commit(root: Path, tmp: Path, final: Path, keep: int) -> None:
    """Rename the finished temp folder into place, point ``latest`` at it, prune old checkpoints."""
    old = None
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync_path(root)
    pointer = root / (LATEST + ".tmp")
    pointer.write_text(final.name + "\n")
    _fsync_path(pointer)
    os.replace(pointer, root / LATEST)
    _fsync_path(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    done = sorted(p for p in root.glob("step_*") if (p / META).is_file() and p.suffix != ".old")
    for stale in done[:-keep] if keep > 0 else []:
        shutil.rmtree(stale, ignore_errors=True)


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


class CheckpointReader:
    """Reads full tensors or slices of one checkpoint (only the shard files that overlap)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_file = self.path / META
        if not meta_file.is_file():
            raise ConfigError(f"{self.path}: not a plait checkpoint (no {META})")
        self.meta = json.loads(meta_file.read_text())
        if self.meta.get("format") != FORMAT:
            raise ConfigError(f"{self.path}: unknown checkpoint format {self.meta.get('format')!r}")
        self._handles: dict[str, Any] = {}  # file -> an open safetensors handle

    def _slice(self, file: str, name: str):
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(str(self.path / file), framework="pt")
        return self._handles[file].get_slice(name)

    def has(self, key: str) -> bool:
        return key in self.meta["tensors"]

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        entry = self.meta["tensors"].get(key)
        if entry is None:
            raise ConfigError(f"{self.path}: checkpoint has no tensor {key!r}")
        shards = sorted(entry["shards"], key=lambda s: s["start"])
        if any(s["dim"] is None for s in shards):
            full = self._slice(shards[0]["file"], key)[:]
            return full if dim is None else full.narrow(dim, start, (stop or full.shape[dim]) - start)
        sdim = shards[0]["dim"]
        if dim is None or dim != sdim:
            full = torch.cat([self._slice(s["file"], key)[:] for s in shards], dim=sdim)
            return full if dim is None else full.narrow(dim, start, (stop or full.shape[dim]) - start)
        stop = entry["shape"][dim] if stop is None else stop
        pieces = []
        for s in shards:
            lo, hi = max(start, s["start"]), min(stop, s["stop"])
            if lo < hi:
                index = tuple([slice(None)] * dim + [slice(lo - s["start"], hi - s["start"])])
                pieces.append(self._slice(s["file"], key)[index])
        return torch.cat(pieces, dim=dim)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every model tensor in full (optimizer state left out): for one device or a Hugging Face export."""
        return {k: self.read(k) for k in self.meta["tensors"] if not k.startswith("optim/")}


def load_checkpoint(pm, optimizer, path: str | Path) -> dict:
    """Load a checkpoint saved under any layout into ``pm`` (and ``optimizer``); returns its metadata."""
    reader = CheckpointReader(path)
    load_local(pm, reader.read)
    if getattr(optimizer, "keeps_masters", False):
        _load_masters(pm, optimizer, reader)
    if optimizer is not None and reader.meta["optimizer"]["param_groups"] is not None:
        _load_optimizer(pm, optimizer, reader)
    layout = reader.meta["layout"]
    same = (layout["tp"], layout["pp"], layout["dp"]) == (pm.ctx.tp_size, pm.ctx.pp_size, pm.ctx.dp_size)
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
    for group, saved in zip(_torch_optimizer(optimizer).param_groups, meta["param_groups"], strict=False):
        group.update({k: v for k, v in saved.items() if k in group})
    names = sorted({k.split("/")[1] for k in reader.meta["tensors"] if k.startswith("optim/")})
    keys = param_keys(pm)
    loaded: dict = {}
    for lt in local_tensors(pm):
        if keys.get(id(lt.tensor)) != lt.key:
            continue
        state = {}
        for name in names:
            full = f"optim/{name}/{lt.key}"
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


def model_config(meta: dict):
    """The plain-model config a checkpoint was saved with (its family's config class; llama if unnamed)."""
    from plait.models.family import family_for_type

    return family_for_type(meta.get("family", "llama")).config_class(**meta["model"])


def export_pretrained(checkpoint: str | Path, out: str | Path) -> Path:
    """Write a Hugging Face folder of the model's family from a checkpoint of any layout (one process)."""
    from plait.models.family import family_of_config
    from plait.models.hf import save_state_dict_pretrained

    path = find_checkpoint(checkpoint)
    if path is None:
        raise ConfigError(f"{checkpoint}: no plait checkpoint there")
    reader = CheckpointReader(path)
    cfg = model_config(reader.meta)
    save_state_dict_pretrained(family_of_config(cfg), cfg, reader.full_state_dict(), out)
    return Path(out)
