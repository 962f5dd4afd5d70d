"""Benchmark: plait generate tokens/s under pipeline parallelism (Gloo, one thread per rank) and on one device.

A random byte-level Llama saved to a temporary Hugging Face folder, loaded the way ``plait generate``
loads it; the same batch of prompts is decoded once to warm up, then timed (decode only, not loading).
Run it on a checkout from before pipelined decoding (``PYTHONPATH=<old>/src``) to compare. Not a test.

    python bench/generate.py --pp 2 --prompts 32 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _model(path: Path, dim: int, layers: int) -> None:
    import torch

    from plait.models import Llama, LlamaConfig

    torch.manual_seed(0)
    Llama(LlamaConfig(vocab_size=256, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, max_seq_len=512,
                      init_std=0.05)).save_pretrained(path)


def _prompts(n: int) -> list[list[int]]:
    return [list(f"prompt {i}: def f(x):".encode()) for i in range(n)]


def _time(model_dir: str, pp: int, n: int, new: int, temperature: float) -> dict:
    """Decode ``n`` prompts twice (warm-up, timed) on this rank; tokens/s of the timed run."""
    import torch

    import plait
    from plait.generation.decode import Sampling, generate_ids
    from plait.generation.job import load_model

    torch.set_num_threads(1)
    model = load_model(model_dir, ctx=plait.init(1, pp, 1) if pp > 1 else None)[0]
    s = Sampling(new, temperature, 8 if temperature else 0, 0)
    generate_ids(model, _prompts(n), s)
    t0 = time.perf_counter()
    out = generate_ids(model, _prompts(n), s)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens_per_s": n * new / seconds, "first": out[0][:8]}


def main() -> None:
    from plait.distributed.launch import run_world

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        _model(path, a.dim, a.layers)
        args = (str(path), a.pp, a.prompts, a.max_new_tokens, a.temperature)
        one = _time(str(path), 1, *args[2:])
        multi = run_world(_time, a.pp, *args, timeout_s=1200)[0] if a.pp > 1 else one
    same = one["first"] == multi["first"]
    print(f"{a.prompts} prompts x {a.max_new_tokens} tokens, dim {a.dim}, {a.layers} layers, T={a.temperature}")
    print(f"  one device (1 thread): {one['tokens_per_s']:8.1f} tokens/s")
    print(f"  pp={a.pp} ({a.pp} processes): {multi['tokens_per_s']:8.1f} tokens/s   same tokens: {same}")
    print(json.dumps({"one": one, f"pp{a.pp}": multi, "same_tokens": same}))


if __name__ == "__main__":
    main()
