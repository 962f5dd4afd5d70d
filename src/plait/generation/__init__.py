"""Text generation with a KV cache (greedy, temperature, top-k) from a plain or parallel model: ``plait.generate``."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from plait.errors import is_integer
from plait.generation.decode import Decoder, Sampling, generate_ids, sample

__all__ = ["Decoder", "Sampling", "generate", "generate_ids", "sample"]

Prompts = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]] | torch.Tensor


def generate(model: Any, prompts: Prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, tokenizer: Any = None, stop_ids: Collection[int] = (),
             stop: Sequence[str] = ()) -> str | list[int] | list[str] | list[list[int]]:
    """Continue each prompt (a string, or a list of token ids) with ``max_new_tokens`` tokens, or fewer: a
    continuation ends before its first token in ``stop_ids`` (end-of-sequence ids), or at the first of the
    ``stop`` strings its text holds (a text is cut before it; an id list ends with the token that completed it),
    and decoding stops once every continuation has ended.

    ``model`` is a plain language model (``plait.models.Llama``, ``Mistral``, ``Qwen2``, ...) or a
    ``ParallelModel`` (then every rank calls this and gets the same result). Strings are encoded with
    ``tokenizer`` (UTF-8 bytes by default) and the continuations are returned decoded, each as the text it adds
    to its prompt (``plait.tokenizers.continuation``: a leading space stays); id lists (or a tensor of ids, [S] or
    [B, S]) give id lists. Greedy when ``temperature == 0``.
    """
    from plait.generation.text import TextTracker, before_stop
    from plait.tokenizers import ByteTokenizer, continuation

    if isinstance(prompts, torch.Tensor):  # token ids [S] or [B, S]: as their lists
        prompts = prompts.tolist()
    single = isinstance(prompts, str) or bool(prompts and is_integer(prompts[0]))
    batch: list[Any] = [prompts] if single else list(prompts)
    texts = bool(batch) and isinstance(batch[0], str)
    tok = tokenizer or ByteTokenizer()
    ids = [tok.encode(p) for p in batch] if texts else [list(map(int, p)) for p in batch]
    stops = [s for s in stop if s]
    trackers = [TextTracker(tok, stops, prompt=p) for p in ids] if stops else None
    out = generate_ids(model, ids, Sampling(max_new_tokens, temperature, top_k, seed),  # checks the context
                       stop_ids=stop_ids, texts=trackers)
    result = [before_stop(continuation(tok, p, o), stops) for p, o in zip(ids, out, strict=True)] if texts else out
    return result[0] if single else result
