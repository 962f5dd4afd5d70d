"""Benchmark: what recovery costs -- the step loop's stall per checkpoint (synchronous vs background save, with
``torch.save`` of the same tensors as the floor of a write in the loop) and the time from a worker's death to
the first step after torchrun restarts the job.

The floor writes a new file every round, as a checkpoint must (the previous one stays until the new one is
complete): on this project's VM (ext4) rewriting one file in place ran about twice as fast as writing the same
bytes to a new file, which would flatter the floor.

``stall``: one Gloo world of 4 CPU ranks, tp2·pp2 (1F1B, 2 micro-batches), a Llama with AdamW state. Rounds of
``--every`` steps end in a save; the three kinds of save take turns round by round (sync, async, torch.save,
sync, ...) so the machine's load hits them alike. Per save: the seconds the loop was blocked (async: the
copy of the state plus any wait for the previous write) and the mean step time of the round after it (a
background write shares the cores with those steps). ``--model small`` is the ``small`` preset (byte vocabulary);
``--model 0.5b`` is Qwen2-0.5B's shape (494M parameters), ``--model 0.1b`` a smaller one of the same family.

``restart``: ``torchrun --standalone --nproc-per-node 2 --max-restarts 1`` runs ``plait train --tp 1 --pp 2
--auto-resume`` on the tiny preset; once step ``--kill-at`` is logged a worker gets SIGKILL; reported: the
seconds from the kill to the restarted workers' start, and to their first logged step. Prints a table and
JSON. Not a test.

    python bench/recovery.py stall --model small
    python bench/recovery.py stall --model 0.5b --every 2 --rounds 3
    python bench/recovery.py restart
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {
    "small": dict(vocab_size=256, dim=256, n_layers=8, n_heads=8, n_kv_heads=4, max_seq_len=1024),
    "0.1b": dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, max_seq_len=1024),
    "0.5b": dict(vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, max_seq_len=1024),
}
KINDS = ("sync", "async", "torch.save")


def _rank(model: str, rounds: int, every: int, seq: int, out: str) -> dict:
    """One rank of the stall benchmark."""
    import torch

    import plait
    from plait.checkpoint import AsyncCheckpointer, init_local, save_checkpoint
    from plait.checkpoint.writer import take_snapshot
    from plait.models import Llama, LlamaConfig
    from plait.optim import build_optimizer

    ctx = plait.init(config=plait.ParallelConfig(tp=2, pp=2, dp=1, microbatches=2))
    cfg = LlamaConfig(**MODELS[model])
    with torch.device("meta"):
        model_ = Llama(cfg)
    params = model_.num_parameters()
    pm = plait.parallelize(model_, ctx, config=ctx.config)
    init_local(pm, 0)
    opt = build_optimizer(pm, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, seq + 1), generator=g)

    def step() -> float:
        t0 = time.perf_counter()
        pm.zero_grad()
        pm.train_step(tokens[:, :-1], tokens[:, 1:])
        opt.step()
        return time.perf_counter() - t0

    saver = AsyncCheckpointer()
    rows: list[dict] = []
    step()  # AdamW state exists from here on
    for r in range(rounds * len(KINDS)):
        kind = KINDS[r % len(KINDS)]
        t0 = time.perf_counter()
        if kind == "sync":
            save_checkpoint(pm, opt, Path(out) / "sync", r, keep=1)
        elif kind == "async":
            saver.save(pm, opt, Path(out) / "async", r, keep=1)
        else:  # the same tensors copied and written by torch.save: what a write in the loop costs at least
            snap = take_snapshot(pm, opt, Path(out) / "plain", r, keep=1)
            with open(Path(out) / f"plain-{r}-{ctx.rank}.pt", "wb") as f:  # a new file, as a checkpoint's
                torch.save(snap.tensors, f)
                f.flush()
                os.fsync(f.fileno())
            del snap
        blocked = time.perf_counter() - t0
        if kind == "torch.save" and r >= len(KINDS):  # the previous round's file, outside the timing
            os.remove(Path(out) / f"plain-{r - len(KINDS)}-{ctx.rank}.pt")
        steps = [step() for _ in range(every)]
        rows.append({"kind": kind, "blocked_s": blocked, "step_s": statistics.mean(steps)})
    saver.wait()
    return {"params": params, "rows": rows}


def stall(args) -> dict:
    from plait.distributed.launch import run_world

    with tempfile.TemporaryDirectory(prefix="plait-bench-ckpt-", dir=args.dir) as out:
        ranks = run_world(_rank, 4, args.model, args.rounds, args.every, args.seq_len, out, timeout_s=3600,
                          threads=1)
    result = {"model": args.model, "params": ranks[0]["params"], "layout": "tp2 pp2", "every": args.every,
              "load": os.getloadavg(), "kinds": {}}
    for kind in KINDS:
        # a save blocks the world as long as its slowest rank: per round, the max over ranks
        mine = [i for i, row in enumerate(ranks[0]["rows"]) if row["kind"] == kind]
        per_round = [max(rk["rows"][i]["blocked_s"] for rk in ranks) for i in mine]
        steps = [max(rk["rows"][i]["step_s"] for rk in ranks) for i in mine]
        result["kinds"][kind] = {"blocked_s": statistics.median(per_round), "blocked_all": per_round,
                                 "step_s_after": statistics.median(steps)}
    sync = result["kinds"]["sync"]["blocked_s"]
    print(f"{args.model} ({result['params'] / 1e6:,.0f}M parameters, AdamW), tp2 pp2, 4 processes; "
          f"load average {result['load'][0]:.1f}")
    print(f"{'save':<12}{'loop blocked (median)':>24}{'vs sync':>10}{'step after (median)':>22}")
    for kind, k in result["kinds"].items():
        print(f"{kind:<12}{k['blocked_s'] * 1e3:>21,.0f} ms{k['blocked_s'] / sync:>10.3f}"
              f"{k['step_s_after'] * 1e3:>19,.0f} ms")
    return result


def restart(args) -> dict:
    from plait.distributed.launch import child_pids

    with tempfile.TemporaryDirectory(prefix="plait-bench-restart-", dir=args.dir) as d:
        metrics = Path(d) / "m.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
               "1", "-m", "plait.cli.main", "train", "--tp", "1", "--pp", "2", "--steps", str(args.kill_at + 40),
               "--seq-len", "32", "--batch-size", "4", "--microbatches", "2", "--max-data-mb", "0.3", "--sample-tokens",
               "0", "--eval-every", "0", "--trace-every", "0", "--cluster", "none", "--checkpoint-every", "5",
               "--auto-resume", "--metrics", str(metrics)]
        proc = subprocess.Popen(cmd, cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not metrics.exists() or len(metrics.read_text().splitlines()) < args.kill_at:
                time.sleep(0.02)
            first = child_pids(proc.pid)
            n = len(metrics.read_text().splitlines())
            os.kill(first[-1], signal.SIGKILL)
            t_kill = time.time()
            while not (set(w := child_pids(proc.pid)) - set(first)) or len(w) < 2:
                time.sleep(0.02)
            t_spawn = time.time()
            while len(metrics.read_text().splitlines()) <= n:  # the restart appends its rows
                time.sleep(0.02)
            t_step = time.time()
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    result = {"kill_to_new_workers_s": t_spawn - t_kill, "kill_to_first_step_s": t_step - t_kill,
              "exit_code": proc.returncode, "load": os.getloadavg()}
    print(f"worker killed -> restarted workers started {result['kill_to_new_workers_s']:.1f} s -> first step "
          f"after the restart {result['kill_to_first_step_s']:.1f} s (exit code {proc.returncode}; load average "
          f"{result['load'][0]:.1f})")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("stall", "restart"))
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--rounds", type=int, default=3, help="saves of each kind")
    ap.add_argument("--every", type=int, default=3, help="steps between saves")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--kill-at", type=int, default=12, help="restart: the step after which a worker is killed")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: the system's temp folder)")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()
    result = stall(args) if args.what == "stall" else restart(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
