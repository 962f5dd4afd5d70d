"""Benchmark: plait generate tokens/s on one device against transformers' ``generate``, and under pipeline
parallelism (pp processes, Gloo, one thread per rank).

A random byte-level Llama saved to a temporary Hugging Face folder; plait loads it the way ``plait generate``
does, transformers' ``LlamaForCausalLM`` from the same folder. Both decode the same batch of prompts greedily
with a KV cache (transformers: left-padded, exactly ``--max-new-tokens`` each), once to warm up, then in
``--trials`` alternating timed rounds (decode only, not loading); the table gives the medians, the ratio
plait / transformers, and whether both chose the same tokens. Not a test.

    python bench/generate.py --pp 2 --prompts 32 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def _plait(model_dir: str, pp: int, n: int, new: int, trials: int):
    """Decode ``n`` prompts ``trials + 1`` times on this rank (the first a warm-up); (seconds of each timed run,
    the tokens)."""
    import torch

    import plait
    from plait.generation.decode import Sampling, generate_ids
    from plait.generation.job import load_model

    torch.set_num_threads(1)
    model = load_model(model_dir, ctx=plait.init(1, pp, 1) if pp > 1 else None)[0]
    s = Sampling(new, 0.0, 0, 0)
    times, out = [], generate_ids(model, _prompts(n), s)
    for _ in range(trials):
        t0 = time.perf_counter()
        out = generate_ids(model, _prompts(n), s)
        times.append(time.perf_counter() - t0)
    return times, out


def _transformers(model_dir: str, n: int, new: int):
    """transformers' greedy ``generate`` of the same prompts (left-padded); a function that times one run and
    returns (seconds, the new tokens of each prompt)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    prompts = _prompts(n)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run():
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                 min_new_tokens=new, pad_token_id=0, use_cache=True)
        return time.perf_counter() - t0, out[:, width:].tolist()

    return run


def main() -> None:
    import torch

    from plait.distributed.launch import run_world

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--trials", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    n, new = a.prompts, a.max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        _model(path, a.dim, a.layers)
        hf = _transformers(str(path), n, new)
        hf()  # warm-up
        plait_s, hf_s = [], []
        for _ in range(a.trials):  # alternating, so a busy machine slows both alike
            seconds, ours = _plait(str(path), 1, n, new, 1)
            plait_s += seconds
            seconds, theirs = hf()
            hf_s.append(seconds)
        multi = run_world(_plait, a.pp, str(path), a.pp, n, new, a.trials, timeout_s=1200)[0] if a.pp > 1 else None
    rate = {"plait": n * new / statistics.median(plait_s), "transformers": n * new / statistics.median(hf_s)}
    if multi is not None:
        rate[f"plait pp={a.pp}"] = n * new / statistics.median(multi[0])
    same = sum(x == y for x, y in zip(ours, theirs, strict=True))
    print(f"{n} prompts x {new} greedy tokens, dim {a.dim}, {a.layers} layers, {a.trials} trials; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"  plait, one device (1 thread):        {rate['plait']:8.1f} tokens/s")
    print(f"  transformers, one device (1 thread): {rate['transformers']:8.1f} tokens/s   "
          f"plait / transformers (tokens/s) {rate['plait'] / rate['transformers']:.2f}x")
    if multi is not None:
        print(f"  plait pp={a.pp} ({a.pp} processes):            {rate[f'plait pp={a.pp}']:8.1f} tokens/s   "
              f"same tokens as one device: {multi[1] == ours}")
    print(f"  prompts whose tokens transformers chose alike: {same} of {n}")
    print(json.dumps({"tokens_per_s": rate, "plait_s": plait_s, "transformers_s": hf_s, "same_as_transformers": same,
                      "load": os.getloadavg()}))


if __name__ == "__main__":
    main()
