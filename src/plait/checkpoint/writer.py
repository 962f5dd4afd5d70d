"""Saving checkpoints: a snapshot of this rank's state (the collective part, copied off the live tensors) and
its write (files, ``meta.json`` last, the rename into place), in the step loop or on a background thread.

A save is two halves. ``take_snapshot`` is collective: rank 0 prepares ``.step_*.tmp``, ZeRO's optimizer state
is gathered, every tensor this rank writes is copied to host memory, and the shard records are gathered for
rank 0's ``meta.json``. ``write_snapshot`` needs no collective: each rank writes its safetensors file as
``*.part`` (with the block checksums of each tensor in its header: plait.checkpoint.checksums), fsyncs it and renames
it into the temp folder; rank 0 waits until every rank's file is there, writes ``meta.json`` (the mark of a
complete checkpoint; the checksums in its shard records), renames the folder to ``step_*`` and points
``latest`` at it; checkpoints beyond the ``keep`` newest are renamed out of sight and deleted on a thread. A
kill at any moment leaves the previous checkpoint the latest complete one.

``save_checkpoint`` runs both halves in the caller (and a barrier: on return the checkpoint is in place).
``AsyncCheckpointer`` runs the write on a thread while training goes on; its next save, and ``wait``, first
wait for the previous write, so at most one snapshot is held. Both give the same files byte for byte.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait.checkpoint.checksums import file_header, record_checksums
from plait.checkpoint.shards import local_tensors, param_keys
from plait.data_parallel.reducer import grad_group
from plait.distributed.collectives import collective
from plait.errors import CommTimeoutError
from plait.files import fsync_path

if TYPE_CHECKING:
    from plait.optim import ParallelOptimizer
    from plait.parallel_model import ParallelModel

FORMAT = "plait-checkpoint/1"
META = "meta.json"
LATEST = "latest"
PRUNED = ".pruned-"  # a checkpoint pruned by a later save, until it is deleted
OPTIM = "optim/"  # the key prefix of optimizer state: optim/<state name>/<parameter key>


def torch_optimizer(optimizer):
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
    group = grad_group(lt.tensor)
    if group is not None:  # an expert under expert parallelism: the lowest rank holding it writes it
        return ctx.rank == min(dist.get_process_group_ranks(group[0]))
    if ctx.dp_rank != 0 or ctx.cp_rank != 0:
        return False  # data- and context-parallel replicas hold the same tensors
    if lt.dim is None:
        return ctx.tp_size == 1 or ctx.tp_rank == 0  # replicated over TP
    return lt.stop > lt.start  # not an all-padding shard


def _local_tensors(pm, states: dict, masters: dict) -> tuple[dict[str, torch.Tensor], dict[str, int | None],
                                                            list[dict], dict]:
    """This rank's tensors to write, the dim each is split along (``LocalTensor.split``), their shard records, and
    optimizer scalars per key. A parameter with an fp32 master (ZeRO with bf16 parameters) is written as its master:
    checkpoints hold the exact weights."""
    ctx = pm.ctx
    tensors: dict[str, torch.Tensor] = {}
    split: dict[str, int | None] = {}
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
                pairs.append((f"{OPTIM}{name}/{lt.key}", value if lt.dim is None else value.narrow(
                    lt.dim, 0, lt.stop - lt.start)))
            else:
                scalars.setdefault(lt.key, {})[name] = float(value)
        for name, t in pairs:
            tensors[name] = t.detach().to("cpu", copy=True).contiguous()
            split[name] = lt.split
            records.append({"name": name, "dim": lt.dim, "start": lt.start, "stop": lt.stop,
                            "shape": lt.full_shape, "dtype": str(t.dtype).removeprefix("torch.")})
    return tensors, split, records, scalars


@dataclass
class Snapshot:
    """One rank's part of a save, held in host memory until written."""

    root: Path
    tmp: Path  # .step_*.tmp, renamed to ``final`` once complete
    final: Path
    step: int
    keep: int
    fname: str
    tensors: dict[str, torch.Tensor]  # copies: training may change the live tensors meanwhile
    split: dict[str, int | None]  # the dim each tensor's checksum blocks are cut along
    files: list[str]  # every rank's file name (rank 0 waits for them)
    meta: dict | None  # rank 0's meta.json
    timeout_s: float


def take_snapshot(pm, optimizer, directory: str | Path, step: int, extra: dict | None = None,
                  keep: int = 3) -> Snapshot:
    """Collective: this rank's state for step ``step``, copied to host memory, and the temp folder ready."""
    ctx = pm.ctx
    root = Path(directory)
    final, tmp = root / f"step_{step:08d}", root / f".step_{step:08d}.tmp"
    if ctx.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".step_*.tmp"):  # a save that never completed (killed, or its job died)
            shutil.rmtree(stale, ignore_errors=True)
        # a save needs room for one checkpoint beside the kept ones, not beside more: those it would prune once it
        # is complete (a run resumed with a lower --keep) go first
        _prune(root, keep)
        tmp.mkdir()
    collective(f"barrier before checkpoint {step}'s snapshot", None, dist.barrier)
    cp = f"-cp{ctx.cp_rank}" if ctx.cp_size > 1 else ""  # experts may be written by any CP rank
    fname = f"pp{ctx.pp_rank}-tp{ctx.tp_rank}{cp}-dp{ctx.dp_rank}.safetensors"
    states = _optimizer_states(optimizer)  # collective under ZeRO: every rank takes part
    masters = optimizer.gathered_masters() if hasattr(optimizer, "gathered_masters") else {}  # collective
    with pm.full_parameters():  # ZeRO-3: every local parameter gathered for the duration (collective)
        tensors, split, records, scalars = _local_tensors(pm, states, masters)  # host copies
    parts: list = [None] * ctx.world_size
    rng = torch.get_rng_state().tolist() if ctx.rank == 0 else None
    collective(f"all-gather of checkpoint {step}'s file records", None,
               lambda: dist.all_gather_object(parts, (fname, records, scalars)))
    meta = _meta(pm, optimizer, step, parts, extra or {}, rng) if ctx.rank == 0 else None
    files = sorted({name for name, recs, _ in parts if recs})  # data-parallel replicas write nothing
    return Snapshot(root, tmp, final, step, keep, fname, tensors, split, files, meta, ctx.timeout_s)


class CheckpointWriteError(RuntimeError):
    """A file of a save could not be written (a full disk, a folder removed under it): the message names the file
    and the checkpoint that stays the latest complete one."""


def write_snapshot(snap: Snapshot, threads: int | None = None) -> None:
    """Write this rank's file; on rank 0 then wait for every rank's, write meta.json and commit. No collective.
    ``threads``: how many threads sum the file's checksums (None: torch's intra-op thread count)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    if snap.tensors:
        part = snap.tmp / (snap.fname + ".part")
        try:
            save_file(snap.tensors, str(part), metadata=file_header(snap.tensors, snap.split, FORMAT, threads))
            fsync_path(part)
            os.replace(part, snap.tmp / snap.fname)
        except (OSError, SafetensorError) as exc:
            part.unlink(missing_ok=True)  # a full disk gets back what the partial file took
            raise _write_error(snap, snap.tmp / snap.fname, exc) from exc
    if snap.meta is None:
        return
    _await_files(snap)
    record_checksums(snap.meta, snap.tmp)
    meta = snap.tmp / META
    try:
        _keep_tokenizer(snap.meta, snap.tmp)
        meta.write_text(json.dumps(snap.meta, indent=1))
        fsync_path(meta)
        fsync_path(snap.tmp)
    except OSError as exc:
        raise _write_error(snap, meta, exc) from exc
    _commit(snap.root, snap.tmp, snap.final, snap.keep)


def _write_error(snap: Snapshot, file: Path, exc: BaseException) -> CheckpointWriteError:
    from plait.checkpoint.store import find_checkpoint

    latest = find_checkpoint(snap.root)
    kept = f"{latest} stays the latest complete checkpoint" if latest else "no complete checkpoint is saved yet"
    full = getattr(exc, "errno", None) == errno.ENOSPC or "(os error 28)" in str(exc)  # safetensors' own error
    if full and latest is not None:
        size = sum(f.stat().st_size for f in latest.iterdir() if f.is_file()) / 1e6
        kept += (f"; free space on the disk of {snap.root} (a checkpoint of this run takes {size:,.0f} MB, and a save "
                 f"needs room for one more beside the {snap.keep or 'all'} kept: --keep), then go on from it")
    elif full:
        kept += f"; free space on the disk of {snap.root}"
    return CheckpointWriteError(f"checkpoint of step {snap.step}: writing {file} failed ({exc}); {kept}")


def _keep_tokenizer(meta: dict, folder: Path) -> None:
    """Rank 0: copy the tokenizer files of the folder the model was trained from (``--model DIR``) into the
    checkpoint's ``TOKENIZER_DIR``, so that generate, serve and export read them wherever the checkpoint is copied
    or that folder moved (plait.tokenizers.trained_tokenizer)."""
    from plait.tokenizers import TOKENIZER_DIR, TOKENIZER_FILES, copy_tokenizer_files

    source = (meta.get("tokenizer") or {}).get("folder")
    if not source or not any((Path(source) / name).is_file() for name in TOKENIZER_FILES):
        return
    (folder / TOKENIZER_DIR).mkdir()
    for name in copy_tokenizer_files(Path(source), folder / TOKENIZER_DIR):
        fsync_path(folder / TOKENIZER_DIR / name)


def _await_files(snap: Snapshot) -> None:
    """Rank 0: wait until every rank's file is in the temp folder (a shared filesystem), at most the timeout."""
    deadline, pause = time.monotonic() + snap.timeout_s, 0.005
    while missing := [f for f in snap.files if not (snap.tmp / f).is_file()]:
        if time.monotonic() > deadline:
            raise CommTimeoutError(f"checkpoint of step {snap.step}: {', '.join(missing)} did not appear in "
                                   f"{snap.tmp} within {snap.timeout_s:.0f}s (did those ranks die while saving? "
                                   "the previous checkpoint stays the latest)")
        time.sleep(pause)
        pause = min(2 * pause, 0.1)


def save_checkpoint(pm: ParallelModel, optimizer: ParallelOptimizer | torch.optim.Optimizer | None,
                    directory: str | Path, step: int, extra: dict | None = None,
                    keep: int = 3) -> Path:
    """Collective: every rank writes its shards; on return the checkpoint is in place. Returns its folder."""
    snap = take_snapshot(pm, optimizer, directory, step, extra, keep)
    write_snapshot(snap)
    collective(f"barrier after checkpoint {step}'s write", None, dist.barrier)
    return snap.final


class AsyncCheckpointer:
    """Saves whose write runs on a background thread (one at a time); ``wait`` before the process ends."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._step: int | None = None
        self.nbytes: int | None = None  # rank 0: the bytes of the last save's tensors (``tensor_bytes``)

    def save(self, pm, optimizer, directory: str | Path, step: int, extra: dict | None = None,
             keep: int = 3) -> Path:
        """Collective: wait for the previous write, snapshot, start writing; returns the folder it will have."""
        self.wait()
        snap = take_snapshot(pm, optimizer, directory, step, extra, keep)
        self._step = step
        self.nbytes = tensor_bytes(snap.meta["tensors"]) if snap.meta is not None else None
        self._thread = threading.Thread(target=self._write, args=(snap,), name=f"plait-checkpoint-{step}",
                                        daemon=True)  # a failing job is not held up by its last write
        self._thread.start()
        return snap.final

    def wait_all(self) -> None:
        """Collective: ``wait`` on every rank, then a barrier; on return rank 0 has committed the last save (the
        other ranks' own writes end before rank 0's commit does)."""
        self.wait()
        collective("barrier after the last checkpoint's write", None, dist.barrier)

    def _write(self, snap: Snapshot) -> None:
        try:  # one thread: the training steps that run meanwhile keep the others
            write_snapshot(snap, threads=1)
        except BaseException as exc:  # raised in the training thread by the next wait
            self._error = exc

    @property
    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Until the write in flight (if any) is done; raises what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the background save of the step-{self._step} checkpoint failed: {error}") from error


def tensor_bytes(tensors: dict, optimizer: bool = True) -> int:
    """The bytes of the tensors a checkpoint's meta.json records (its ``tensors``), as its shard files hold them:
    the weights and the optimizer state, or (not ``optimizer``) the weights alone."""
    return sum(math.prod(t["shape"]) * torch.empty(0, dtype=getattr(torch, t["dtype"])).element_size()
               for key, t in tensors.items() if optimizer or not key.startswith(OPTIM))


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
                  for g in torch_optimizer(optimizer).state_dict()["param_groups"]]
    ctx = pm.ctx
    return {"format": FORMAT, "step": step, "tensors": tensors, "optimizer": {
        "type": type(optimizer).__name__ if optimizer is not None else None, "param_groups": groups,
        "scalars": optim_scalars, "steps": getattr(optimizer, "steps", None)},  # steps: updates made
        "layout": {"tp": ctx.tp_size, "pp": ctx.pp_size, "dp": ctx.dp_size,
        "cp": ctx.cp_size, "schedule": pm.schedule.name if hasattr(pm.schedule, "name") else None},
        "rng_rank0": rng, **extra}


def _commit(root: Path, tmp: Path, final: Path, keep: int) -> None:
    """Rename the finished temp folder into place, point ``latest`` at it, prune old checkpoints (renamed out of
    sight here, deleted by ``_delete_pruned``)."""
    old = None
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync_path(root)
    pointer = root / (LATEST + ".tmp")
    pointer.write_text(final.name + "\n")
    fsync_path(pointer)
    os.replace(pointer, root / LATEST)
    fsync_path(root)
    _prune(root, keep, [old] if old is not None else [])


def _prune(root: Path, keep: int, also: list[Path] | tuple = ()) -> None:
    """Prune ``also`` and the complete checkpoints of ``root`` but the ``keep`` newest (0: none): renamed out of
    sight here, deleted by ``_delete_pruned``."""
    done = sorted(p for p in root.glob("step_*") if (p / META).is_file() and p.suffix != ".old")
    for stale in [*also, *(done[:-keep] if keep > 0 else [])]:
        stale.rename(root / f"{PRUNED}{stale.name}-{uuid.uuid4().hex[:8]}")
    _delete_pruned(root)


def _delete_pruned(root: Path) -> None:
    """Delete the pruned checkpoints (and any a killed process left) on a thread of their own: freeing a
    checkpoint's blocks takes a good part of what writing them took, and rank 0 does it for every rank's
    files while the others wait at the save's barrier. Not a daemon thread: the interpreter lets it finish
    before the process exits."""
    pruned = sorted(root.glob(PRUNED + "*"))

    def delete() -> None:
        for p in pruned:
            shutil.rmtree(p, ignore_errors=True)

    if pruned:
        threading.Thread(target=delete, name="plait-checkpoint-prune").start()
