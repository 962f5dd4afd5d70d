"""``bench/gpu_check.py``'s generate section: ``plait.generate`` on one device beside transformers' ``generate``
(the same weights, prompts and greedy decoding with its KV cache), tokens per second at batch 1 and 32."""

from __future__ import annotations

import time
from pathlib import Path


def generate_section(device, sizes: dict, folder: Path) -> dict:
    import torch

    import plait
    from plait.devices import synchronize
    from plait.models import Llama

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Llama.from_pretrained(folder, dtype=dtype).to(device).eval()
    vocab, new = model.config.vocab_size, sizes["new_tokens"]
    g = torch.Generator().manual_seed(0)
    out: dict = {"new_tokens": new, "prompt_tokens": sizes["prompt"], "dtype": str(dtype).replace("torch.", "")}
    for batch in (1, 32):
        prompts = torch.randint(0, vocab, (batch, sizes["prompt"]), generator=g).tolist()
        plait.generate(model, prompts, max_new_tokens=2)  # warm-up: kernels, allocator
        synchronize(device)
        t0 = time.perf_counter()
        plait.generate(model, prompts, max_new_tokens=new)
        synchronize(device)
        out[f"generate_tokens_per_s_batch{batch}"] = batch * new / (time.perf_counter() - t0)
    del model
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    for batch in (1, 32):  # the peer: the same weights, prompts and greedy decoding with its KV cache
        ids = torch.randint(0, vocab, (batch, sizes["prompt"]), generator=g).to(device)
        kw = dict(do_sample=False, pad_token_id=0)
        hf.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)
        synchronize(device)
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        synchronize(device)
        out[f"hf_generate_tokens_per_s_batch{batch}"] = batch * new / (time.perf_counter() - t0)
    out["generate_tokens_per_s"] = {1: out["generate_tokens_per_s_batch1"], 32: out["generate_tokens_per_s_batch32"]}
    return out
