"""Benchmark: what a checkpoint's checksums cost -- the save and the load of a model's checkpoint with them (a CRC-32
of every tensor taken from the host copy a save writes; every tensor read whole and checked on its first read)
beside the same without them (the save's checksums turned off, so the checkpoint is one of before they were kept
and loads unchecked), and the pass of ``plait train --resume --dry-run`` that reads and checks every tensor on one
process (CheckpointReader.check_files).

One process (world 1), a Llama of ``--dim``/``--layers``/``--vocab`` in float32 without optimizer state (the
default: 115M parameters, a 461 MB checkpoint). The two kinds take turns round by round (with, without, without,
with, ...) so the machine's load hits them alike; each round saves into a fresh folder, loads it back into the
model (plait.checkpoint.load_checkpoint, warm page cache, as a resume right after a save) and deletes it. Prints
the median of each figure, the ratio with/without, and JSON. Not a test.

    python bench/checksums.py
    python bench/checksums.py --layers 8 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=4, help="rounds per kind")
    a = ap.parse_args()

    import torch

    import plait
    from plait.checkpoint import CheckpointReader, checksums, load_checkpoint, local_tensors, save_checkpoint
    from plait.models import Llama, LlamaConfig

    crcs = checksums.tensor_checksums
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.dim // 64,
                              max_seq_len=256))
    pm = plait.parallelize(model, plait.init(1, 1, 1), microbatches=1)
    split = {lt.key: lt.split for lt in local_tensors(pm)}  # the dims a save cuts checksum blocks along
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    times: dict[str, dict[str, list[float]]] = {k: {n: [] for n in ("save", "load", "check", "crc32")}
                                                for k in ("with", "without")}
    root = Path(tempfile.mkdtemp(prefix="plait-checksums-", dir=os.environ.get("BENCH_DIR")))
    try:
        for r in range(a.rounds):
            for kind in (("with", "without") if r % 2 == 0 else ("without", "with")):
                checksums.tensor_checksums = crcs if kind == "with" else (lambda tensors, split, threads=None: {})
                folder = root / f"{kind}-{r}"
                t0 = time.perf_counter()
                path = save_checkpoint(pm, None, folder, step=1)
                t1 = time.perf_counter()
                load_checkpoint(pm, None, path)
                t2 = time.perf_counter()
                CheckpointReader(path).check_files()  # --dry-run's pass (nothing to check without checksums)
                t3 = time.perf_counter()
                crcs(model.state_dict(), split)  # the checksums alone, on the memory a save writes
                t4 = time.perf_counter()
                for name, dt in (("save", t1 - t0), ("load", t2 - t1), ("check", t3 - t2), ("crc32", t4 - t3)):
                    times[kind][name].append(dt)
                shutil.rmtree(folder)
    finally:
        checksums.tensor_checksums = crcs
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()[0]
    med = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in times.items()}
    print(f"checkpoint of {size / 1e6:.0f} MB ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
          f"float32), {a.rounds} rounds per kind, load average {load:.1f}")
    print(f"{'':28}{'with checksums':>16}{'without':>12}{'ratio':>8}")
    for name, label in (("save", "save_checkpoint"), ("load", "load_checkpoint"), ("check", "--dry-run check_files")):
        w, wo = med["with"][name], med["without"][name]
        ratio = f"{w / wo:.2f}x" if wo > 0.001 else "-"
        print(f"{label:28}{w * 1e3:>13.0f} ms{wo * 1e3:>9.0f} ms{ratio:>8}")
    crc = statistics.median(times["with"]["crc32"] + times["without"]["crc32"])
    print(f"{'crc32 of the tensors alone':28}{crc * 1e3:>13.0f} ms ({size / crc / 1e9:.1f} GB/s)")
    print(json.dumps({"bytes": size, "rounds": a.rounds, "load_average": load, "median_s": med, "all_s": times}))


if __name__ == "__main__":
    main()
