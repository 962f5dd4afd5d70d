"""Benchmark: context-parallel ring attention with a sliding window — one rank's work on the blocks it sees.

Under ``cp_comm="ring"`` every K/V block passes through every rank; with a sliding window a rank attends (forward
and backward, ``plait.context_parallel.blockwise``) only to the blocks some query of its own sees
(``plait.context_parallel.layout.sees``), as ``plait.context_parallel.attention`` does. The peer, in the same
process with trials alternating, is the same rank attending to every block it receives (what the ring did before:
the tiles a block's mask hides were skipped, but the block's mask, its repeated K/V and the merge were built).
One process and one thread: the exchange itself is not timed (every block still travels the ring). Checked
equal before timing.

    .venv/bin/python bench/context_window.py [--cases 16384:8:256:2,16384:4:256:0] [--trials 3] [--json out.json]

A case is sequence length : cp : window : rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def rank_work(seq: int, cp: int, window: int, rank: int, every_block: bool, inputs) -> object:
    """Forward and backward of one rank's ring attention over the cp blocks (every one, or those it sees)."""
    import torch

    from plait.context_parallel.blockwise import attend, attend_backward
    from plait.context_parallel.layout import local_positions, sees

    q, blocks, do = inputs
    s = seq // cp
    q_pos = local_positions(s, cp, rank)
    seen = [src for src in range(cp) if every_block or sees(rank, src, s, cp, window)]
    out = lse = None
    for src in seen:
        k, v = blocks[src]
        out, lse = attend(q, k, v, q_pos, local_positions(s, cp, src), window, s // 2, out, lse)
    assert out is not None and lse is not None
    delta = (do * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(q)
    for src in seen:
        k, v = blocks[src]
        dq += attend_backward(q, k, v, q_pos, local_positions(s, cp, src), window, s // 2, lse, do, delta)[0]
    return out, dq


def run(seq: int, cp: int, window: int, rank: int, trials: int) -> dict:
    import torch

    from plait.context_parallel.layout import sees

    torch.set_num_threads(1)
    s = seq // cp
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, 4, s, 16, generator=g),
              [(torch.randn(1, 2, s, 16, generator=g), torch.randn(1, 2, s, 16, generator=g)) for _ in range(cp)],
              torch.randn(1, 4, s, 16, generator=g))
    every, only = (rank_work(seq, cp, window, rank, flag, inputs) for flag in (True, False))
    assert all(torch.equal(a, b) for a, b in zip(every, only, strict=True)), "the skipped blocks changed the result"
    times: dict[bool, list[float]] = {True: [], False: []}
    load = os.getloadavg()[0]
    for _ in range(trials):
        for flag in (True, False):
            t0 = time.perf_counter()
            rank_work(seq, cp, window, rank, flag, inputs)
            times[flag].append(time.perf_counter() - t0)
    a, b = statistics.median(times[True]), statistics.median(times[False])
    return {"seq": seq, "cp": cp, "window": window, "rank": rank,
            "blocks_seen": sum(sees(rank, k, s, cp, window) for k in range(cp)), "every_block_s": a,
            "seen_only_s": b, "ratio": b / a, "load_before": load, "load_after": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="16384:8:256:2,16384:4:256:0", help="seq:cp:window:rank, ...")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        seq, cp, window, rank = (int(x) for x in case.split(":"))
        row = run(seq, cp, window, rank, args.trials)
        rows.append(row)
        print(f"S={seq:6} cp={cp} window={window} rank {rank}: blocks seen {row['blocks_seen']}/{cp}  every block "
              f"{row['every_block_s'] * 1e3:8.1f} ms  seen only {row['seen_only_s'] * 1e3:8.1f} ms "
              f"({row['ratio']:.2f}x)  load {row['load_before']:.1f}-{row['load_after']:.1f}", flush=True)
    print(json.dumps(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
