"""Training data: `plait data prepare` against Hugging Face `datasets` `.map(batched=True, num_proc=N)` with the
same tokenizer on the same JSON lines; the loader's tokens/s against what a training step consumes; the peak
memory of `plait train --data` at 1x and 10x the corpus.

    python bench/data.py [--mb 16] [--trials 2] [--json out.json]
    python bench/data.py --src corpus.jsonl --tokenizer DIR --workers 2   # prepare only, on your own data

--src: time the prepare of your own JSON lines (one file with a "text" field, no malformed lines: `datasets`
stops at the first) against the peer instead of the generated corpus, then stop; --tokenizer: a folder holding
tokenizer.json instead of the small BPE trained here.

Trials alternate plait and its peer so that a busy machine slows both alike; the figures are medians and the
ratio is taken within each trial pair. Each worker tokenizes on one core (TOKENIZERS_PARALLELISM=false for both).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # data_util: the corpus generator and the BPE tokenizer of the tests


def make_corpus(path: Path, mb: float) -> int:
    from data_util import documents, write_jsonl

    docs = documents(2000, seed=7, max_words=400)
    write_jsonl(path, docs)
    one = path.read_bytes()
    with open(path, "wb") as f:
        for _ in range(max(1, round(mb * 1e6 / len(one)))):
            f.write(one)
    return path.stat().st_size


def cpu_seconds() -> float:
    """User + system seconds of this process and its reaped children (the workers of both sides)."""
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                   resource.getrusage(resource.RUSAGE_CHILDREN)))


def plait_prepare(src: Path, tok: Path, out: Path, workers: int) -> float:
    from plait.data import prepare

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    prepare([str(src)], str(tok), out, workers=workers, held_out=0.005)
    return time.perf_counter() - t0


def hf_map(src: Path, tok: Path, cache: Path, workers: int) -> float:
    """The peer: load the JSON lines with `datasets` (a fresh cache: no reuse) and map the tokenizer over it."""
    import datasets
    from tokenizers import Tokenizer

    shutil.rmtree(cache, ignore_errors=True)
    datasets.disable_progress_bars()
    tokenizer = Tokenizer.from_file(str(tok / "tokenizer.json"))

    def tokenize(batch):
        return {"ids": [e.ids for e in tokenizer.encode_batch_fast(batch["text"], add_special_tokens=False)]}

    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(src), split="train", cache_dir=str(cache))
    ds.map(tokenize, batched=True, num_proc=workers if workers > 1 else None, remove_columns=ds.column_names)
    return time.perf_counter() - t0


def prepare_bench(work: Path, mb: float, trials: int, src: Path | None = None, tok: Path | None = None,
                  workers_list: tuple[int, ...] = (1, 2)) -> list[dict]:
    from data_util import bpe_folder

    tok = tok or bpe_folder(work / "bpe", vocab_size=2000)
    if src is None:
        src = work / "corpus.jsonl"
        make_corpus(src, mb)
    size = src.stat().st_size
    rows = []
    for workers in workers_list:
        ours, peer, cpu = [], [], []  # cpu: (plait, datasets) CPU seconds of each trial, less load-dependent
        for _ in range(trials):
            c0 = cpu_seconds()
            ours.append(plait_prepare(src, tok, work / "prepared", workers))
            c1 = cpu_seconds()
            peer.append(hf_map(src, tok, work / "hf-cache", workers))
            cpu.append((round(c1 - c0, 1), round(cpu_seconds() - c1, 1)))
        rows.append({"workers": workers, "mb": size / 1e6, "plait_mb_s": size / 1e6 / statistics.median(ours),
                     "datasets_mb_s": size / 1e6 / statistics.median(peer),
                     "ratio": statistics.median(p / o for o, p in zip(ours, peer, strict=True)),
                     "plait_s": [round(t, 2) for t in ours], "datasets_s": [round(t, 2) for t in peer],
                     "cpu_s": cpu})
    return rows


def loader_bench(dataset: Path, batch: int = 16, seq: int = 128, steps: int = 400) -> dict:
    """Tokens/s one rank draws from the prepared set, against one training step of the tiny preset here."""
    import torch

    from plait.data.stream import open_data
    from plait.models import Llama, LlamaConfig
    from plait.train.config import PRESETS

    data = open_data([str(dataset)], "tiny", 256, seq, batch, seed=0, max_mb=1)
    t0 = time.perf_counter()
    for k in range(steps):
        data.batch(k)
    draw = steps * batch * seq / (time.perf_counter() - t0)
    model = Llama(LlamaConfig(**PRESETS["tiny"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for k in range(6):
        x, y = data.batch(k)
        t0 = time.perf_counter()
        model.loss(x, y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    consume = batch * seq / statistics.median(times[1:])
    return {"batch": batch, "seq_len": seq, "loader_tokens_s": draw, "train_tokens_s": consume, "ratio": draw / consume}


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (from /proc)."""
    from plait.distributed.launch import child_pids

    total, todo = 0, [pid]
    while todo:
        q = todo.pop()
        todo += child_pids(q)
        try:
            for line in Path(f"/proc/{q}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def rss_bench(work: Path, src: Path, steps: int = 30) -> list[dict]:
    """Peak RSS summed over `plait train --data` (dp 2: 2 workers + the launcher) at 1x and 10x the corpus."""
    from plait.data import prepare

    big = work / "corpus10.jsonl"
    one = src.read_bytes()
    with open(big, "wb") as f:
        for _ in range(10):
            f.write(one)
    rows = []
    for name, path in (("1x", src), ("10x", big)):
        out = work / f"set-{name}"
        shutil.rmtree(out, ignore_errors=True)
        meta = prepare([str(path)], "bytes", out, workers=2)
        cmd = [sys.executable, "-m", "plait.cli.main", "train", "--data", str(out), "--tp", "1", "--pp", "1", "--dp",
               "2", "--microbatches", "1", "--steps", str(steps), "--seq-len", "128", "--batch-size", "16",
               "--eval-every", "10", "--sample-tokens", "0", "--cluster", "none", "--checkpoint-dir",
               str(work / f"ck-{name}")]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _tree_rss(proc.pid))
            time.sleep(0.1)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.read())
        rows.append({"corpus": name, "jsonl_mb": path.stat().st_size / 1e6,
                     "train_tokens": meta["splits"]["train"]["tokens"], "peak_rss_mb": peak / 1e6})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=16.0, help="size of the JSON-lines corpus in MB")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--src", type=Path, default=None, help="your own JSON lines: time the prepare only")
    ap.add_argument("--tokenizer", type=Path, default=None, help="a folder holding tokenizer.json")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    load = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="plait-bench-data-"))
    if args.src is not None:
        try:
            rows = prepare_bench(work, 0, args.trials, args.src, args.tokenizer, tuple(args.workers))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(json.dumps({"load": [load, os.getloadavg()[0]], "prepare": rows}))
        return 0
    try:
        prep = prepare_bench(work, args.mb, args.trials)
        rss = rss_bench(work, work / "corpus.jsonl")
        loader = loader_bench(work / "set-1x")
        load_end = os.getloadavg()[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"prepare: {prep[0]['mb']:.1f} MB of JSON lines, BPE (2,000 ids); load {load:.1f}-{load_end:.1f}",
              title_justify="left")
    for c in ("workers", "plait MB/s", "datasets .map MB/s", "plait / datasets"):
        t.add_column(c, justify="right")
    for r in prep:
        t.add_row(str(r["workers"]), f"{r['plait_mb_s']:.2f}", f"{r['datasets_mb_s']:.2f}", f"{r['ratio']:.2f}x")
    console.print(t)
    console.print(f"loader: {loader['loader_tokens_s']:,.0f} tokens/s drawn by one rank vs "
                  f"{loader['train_tokens_s']:,.0f} tokens/s consumed by a tiny-preset training step here "
                  f"({loader['ratio']:.0f}x)")
    t = Table(title="plait train --data (dp 2, 30 steps): peak RSS summed over its processes", title_justify="left")
    for c in ("corpus", "JSON lines MB", "training tokens", "peak RSS MB"):
        t.add_column(c, justify="right")
    for r in rss:
        t.add_row(r["corpus"], f"{r['jsonl_mb']:.0f}", f"{r['train_tokens']:,}", f"{r['peak_rss_mb']:,.0f}")
    console.print(t)
    result = {"load": [load, load_end], "prepare": prep, "loader": loader, "rss": rss}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
