"""``plait data prepare``: tokenize text sources in worker processes into a prepared dataset, atomically.

Workers read their own tasks (plait.data.sources, plait.data.records), append the EOS to every document, send
each document to the held-out split when the hash of its text falls under ``held_out`` (so duplicates share a
split), and write one shard per split per task into a work folder beside the destination. The parent keeps a
record of each finished task there (plait.data.resume), then writes the document indexes and ``meta.json`` last
and renames the folder into place: a prepare stopped at any moment leaves no dataset at ``out``, and the next
prepare of the same inputs and options into ``out`` resumes from the tasks it finished. Ctrl-C or SIGTERM ends
the workers (``Stopped``); after a SIGKILL they end with their parent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from plait.data.chat import ChatSpec
from plait.data.encode import encode_into
from plait.data.fields import check_fields, parse_fields
from plait.data.format import SPLITS, dtype_for, is_prepared, write_meta
from plait.data.records import read_task
from plait.data.resume import TaskResult, Work, open_work, plan
from plait.data.shards import ShardSink, file_digest
from plait.data.skipped import Skipped, source_meta
from plait.data.sources import CHUNK, BadRecord, Source, Task, discover, tasks, where
from plait.data.tokens import TokenizerSpec, Tokens
from plait.distributed.parent import end_with_parent
from plait.errors import ConfigError, check_output_path
from plait.files import fsync_path
from plait.words import counted

if TYPE_CHECKING:
    from rich.console import Console

@dataclass
class Job:
    """What every task needs besides itself (sent once to each worker)."""

    spec: TokenizerSpec
    eos: int
    dtype: str
    held_out: float
    text_field: str
    skip_bad: bool
    folder: str
    chat: ChatSpec | None = None  # --chat: records' messages through the chat template, with loss masks


_POOL_WORKER: dict[str, Encoder] = {}  # a pool worker process's encoder (``_init_worker``); empty elsewhere


class Stopped(BaseException):
    """SIGTERM (``kill``, a batch scheduler's stop) during a prepare, raised in its main thread as Ctrl-C raises
    KeyboardInterrupt: the workers are ended on the way out, the finished tasks kept for a resume."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While active (main thread only), SIGTERM raises ``Stopped`` instead of ending the process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _init_worker(job: Job) -> None:
    """A pool worker: Ctrl-C (SIGINT to the whole process group) is the parent's to handle; it ends the pool.
    The worker started with SIGINT blocked (``_execute``), so a Ctrl-C while it imported is dropped here too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    end_with_parent(os.getppid())  # a SIGKILLed prepare's workers end with it
    if hasattr(signal, "SIGPIPE"):  # its result pipe closed (the parent dying, before the kernel's kill): end quietly
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _POOL_WORKER["encoder"] = Encoder(job)


def _run_in_worker(task: Task) -> TaskResult:
    return _POOL_WORKER["encoder"](task)


class Encoder:
    """Reads, encodes and writes the tasks of ``job``, with its tokenizer and chat renderer loaded once (in each
    pool worker; in the prepare's own process for one worker)."""

    def __init__(self, job: Job) -> None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers says how many
        self.job, self.tok = job, job.spec.load()
        self.chat = job.chat.load() if job.chat is not None else None

    def __call__(self, task: Task) -> TaskResult:
        job = self.job
        got = read_task(task, task.field, job.skip_bad, self.chat)
        sinks = {s: ShardSink(Path(job.folder), s, task.index, job.dtype, job.eos, got.spans is not None)
                 for s in SPLITS}
        try:
            encode_into(dict(sinks), got.docs, self.tok, job.held_out, got.spans, got.keys)
        except BaseException:
            for sink in sinks.values():
                sink.abandon()
            raise
        written = [w for sink in sinks.values() for w in sink.close()]
        return TaskResult(task.index, task.source, {k: np.asarray(v.lengths, dtype=np.int64) for k, v in sinks.items()},
                          {k: v.loss for k, v in sinks.items()}, Skipped.of(got.bad), got.hash.digest(), task.nbytes,
                          written)


def prepare(sources: list[str], tokenizer: str, out: str | Path, *, text_field: str | list[str] = "text",
            workers: int | None = None, held_out: float = 0.005, eos: str | None = None, skip_bad: bool = False,
            force: bool = False, console: Console | None = None, chat: ChatSpec | None = None,
            restart: bool = False) -> dict:
    """Tokenize ``sources`` with ``tokenizer`` ("bytes", a folder or a tokenizer.json) into the prepared
    dataset ``out``; returns its metadata. ``console`` (rich): progress bar and summary table. ``chat``: read
    each record's messages (``chat.field``) through the tokenizer folder's chat template instead of
    ``text_field`` (FIELD for every source, SRC=FIELD for one: plait.data.fields), and store the loss mask
    (plait.data.chat). A prepare into ``out`` that was stopped is
    resumed from the tasks it finished (plait.data.resume); ``restart`` discards them."""
    out = Path(out)
    if not 0 <= held_out < 1:
        raise ConfigError(f"--held-out {held_out}: a fraction of the documents in [0, 1)")
    if out.exists() and not force:
        raise ConfigError(f"--out {out} exists; choose another folder or pass --force to replace it")
    check_output_path("--out", str(out), folder=True)
    if out.exists() and not (is_prepared(out) or out.is_dir() and not any(out.iterdir())):
        raise ConfigError(f"--out {out} --force: {out} is not a prepared dataset (no meta.json), and --force replaces "
                          "only a prepared dataset or an empty folder, never other files; choose another --out")
    spec = TokenizerSpec(tokenizer)
    tok = spec.load()
    found = discover(sources)
    default, own = parse_fields([text_field] if isinstance(text_field, str) else text_field, sources)
    check_fields(default, own, chat, found)
    renderer = _check_chat(chat, found)
    field = chat.field if chat is not None else default
    job = Job(spec, tok.eos(eos), dtype_for(tok.vocab_size), held_out, field, skip_bad, "", chat)
    todo = tasks(found, field, chat is not None)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _sigterm_raises():
        work, kept = open_work(out, plan(found, todo, _options(job, tok, own, renderer)), restart)
        try:
            job.folder = str(work.folder)
            left = [t for t in todo if t.index not in kept]
            if kept and console is not None:
                shards = sum(w.bytes for r in kept.values() for w in r.written)
                console.print(f"prepare: resuming {work.folder}: {len(kept)} of {len(todo)} tasks kept "
                              f"({shards / 1e6:,.1f} MB of shards intact), {len(left)} to do", soft_wrap=True)
            t0 = time.perf_counter()
            done = _execute(left, job, workers or os.cpu_count() or 1, sum(t.nbytes for t in left), console,
                            work.record)
            left = []  # every task done: a failure from here on (nothing to train on) leaves nothing to resume
            results = sorted([*kept.values(), *done], key=lambda r: r.index)
            meta = _meta(found, results, tok, job, time.perf_counter() - t0)
            if renderer is not None:
                meta["chat"] = {"messages_field": renderer.spec.field, "loss_on": renderer.spec.loss_on,
                                "template": renderer.source, "method": renderer.method,
                                "template_kwargs": renderer.kwargs}
            _finish(work, out, results, meta, force)
        except BaseException:  # Ctrl-C, SIGTERM, a full disk: the finished tasks stay for the next prepare
            work.release(failed=True, resumable=bool(left))
            raise
        work.release()
    if console is not None:
        from plait.data.report import prepare_summary

        console.print(prepare_summary(meta, out))
    return meta


def _options(job: Job, tok: Tokens, own: dict[str, str], renderer) -> dict:
    """The options a prepared dataset's bytes depend on, by flag (what a resumed prepare must share)."""
    fields = [job.text_field, *(f"{src}={field}" for src, field in sorted(own.items()))] if renderer is None else []
    options = {"--tokenizer": tok.fingerprint, "--eos": job.eos, "--held-out": job.held_out,
               "--text-field": " ".join(fields), "--skip-bad": job.skip_bad, "--chat": renderer is not None}
    if renderer is not None:
        templates = json.dumps(renderer.chat.templates, sort_keys=True).encode()
        options |= {"--messages-field": renderer.spec.field, "--loss-on": renderer.spec.loss_on,
                    "--split-turns": renderer.spec.split_turns, "--chat-template-kwargs": renderer.kwargs,
                    "--chat-template": hashlib.blake2b(templates, digest_size=16).hexdigest()}
    return options


def _check_chat(chat: ChatSpec | None, found: list[Source]):
    """The loaded chat template (None without ``chat``); ConfigError for plain text sources, which hold no
    records of messages."""
    if chat is None:
        return None
    text = [s for s in found if s.kind == "text"]
    if text:
        raise ConfigError(f"--chat reads records of messages (.jsonl/.json/.ndjson, .parquet or a datasets "
                          f"folder), but SRC {text[0].path} holds plain text ({text[0].files[0]})")
    return chat.load()


def _execute(todo: list[Task], job: Job, workers: int, total: int, console: Console | None,
             record: Callable[[TaskResult], None]) -> list[TaskResult]:
    """Run the tasks (in this process for one worker, else a pool of spawned processes), in task order;
    ``record`` keeps each as it ends."""
    from plait.data.report import prepare_progress

    results: list[TaskResult] = []
    workers = 1 if workers == 1 or len(todo) <= 1 else min(workers, len(todo))
    doing = f"{counted(workers, 'worker')}, {CHUNK >> 20} MB chunks"  # the bar moves as each chunk is done
    with prepare_progress(console, total, doing) as bar:
        try:
            if workers == 1:
                saved = os.environ.get("TOKENIZERS_PARALLELISM")
                try:
                    encode = Encoder(job)
                    for t in todo:
                        results.append(encode(t))
                        record(results[-1])
                        bar.advance(results[-1])
                finally:
                    _restore("TOKENIZERS_PARALLELISM", saved)
            else:
                import multiprocessing as mp

                with _sigint_blocked():  # until each worker ignores it (a Ctrl-C while they start: no tracebacks)
                    pool = mp.get_context("spawn").Pool(workers, _init_worker, (job,))
                with pool:
                    for r in pool.imap(_run_in_worker, todo):
                        results.append(r)
                        record(r)
                        bar.advance(r)
        except BadRecord as rec:
            raise ConfigError(f"{where(rec)}: {rec.why} (pass --skip-bad to skip such records and count them)"
                              ) from None
    return results


@contextmanager
def _sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread: the processes started meanwhile inherit the mask (through fork and exec)
    until ``_init_worker``; a Ctrl-C meanwhile reaches this process once it is unblocked."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # its start unblocks SIGINT: started now, it is not started again
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _meta(found: list[Source], results: list[TaskResult], tok: Tokens, job: Job, seconds: float) -> dict:
    splits = {}
    for split in SPLITS:
        lengths = [r.lengths[split] for r in results]
        shards: list[dict] = [{"file": f"{split}/{r.index:06d}.bin", "tokens": int(n.sum())}
                              for r, n in zip(results, lengths, strict=True) if n.sum() > 0]
        if job.chat is not None:  # the loss mask beside each shard
            for shard in shards:
                shard["mask"] = shard["file"].removesuffix(".bin") + ".mask"
        splits[split] = {"documents": int(sum(len(n) for n in lengths)),
                         "tokens": sum(int(n.sum()) for n in lengths), "shards": shards,
                         "loss_tokens": sum(r.loss_tokens[split] for r in results)}
    if splits["train"]["tokens"] == 0:
        raise _no_training_documents(found, results, sum(len(r.lengths["held_out"]) for r in results), job.held_out)
    src = []
    for i, s in enumerate(found):
        mine = [r for r in results if r.source == i]
        digest = hashlib.blake2b(b"".join(r.digest for r in mine), digest_size=16)
        if s.kind in ("parquet", "hf"):  # the workers read decoded columns: hash the files here
            files = s.files if s.kind == "parquet" else list(s.files[0].rglob("*"))
            for f in sorted(p for p in files if p.is_file()):
                digest.update(file_digest(f))
        read = {} if s.kind == "text" or job.chat is not None else {"text_field": s.field or job.text_field}
        src.append({"path": s.path, "kind": s.kind, "files": len(s.files), "bytes": s.bytes, **read,
                    "blake2b": digest.hexdigest(), **source_meta([r.skipped for r in mine]),
                    "documents": int(sum(len(r.lengths[k]) for r in mine for k in SPLITS)),
                    "tokens": int(sum(r.lengths[k].sum() for r in mine for k in SPLITS))})
    return {"tokenizer": {"kind": "bytes" if tok.tok is None else "file", "name": tok.name,
                          "fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size, "eos": job.eos},
            "dtype": job.dtype, "held_out_fraction": job.held_out, "text_field": job.text_field,
            "splits": splits, "sources": src, "seconds": round(seconds, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _no_training_documents(found: list[Source], results: list[TaskResult], held: int, share: float) -> ConfigError:
    """Why a prepare found nothing to train on: empty files, all skipped (the first one), or all held out."""
    first = next((b for r in results for b in r.skipped.examples), None)
    why = ("every SRC is empty (0 bytes): name files that hold text" if all(s.bytes == 0 for s in found) else
           f"every document went to the held-out split: lower --held-out {share:g}" if held else
           f"every record was skipped, the first at {where(first)}: {first.why}" if first else "no record holds text")
    return ConfigError(f"SRC {' '.join(s.path for s in found)}: no documents for the training split ({held} held out, "
                       f"{sum(r.skipped.count for r in results)} skipped): {why}")


def _finish(work: Work, out: Path, results: list[TaskResult], meta: dict, force: bool) -> None:
    """Document indexes, then meta.json, then the rename into place (replacing ``out`` when ``force``)."""
    tmp = work.folder
    for split in SPLITS:
        lengths = np.concatenate([r.lengths[split] for r in results]) if results else np.zeros(0, np.int64)
        np.save(tmp / split / "docs.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    write_meta(tmp, meta)
    work.clear()
    old = None
    if out.exists() and force:
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError as exc:  # --out appeared meanwhile: another prepare into it finished first
        if old is not None:
            os.rename(old, out)
        raise ConfigError(f"--out {out}: made by someone else while this prepare ran (another prepare into it?), "
                          f"so this dataset is not put there ({exc.strerror}); choose another --out") from None
    fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

