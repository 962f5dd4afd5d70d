"""Text generation with a KV cache (greedy, temperature, top-k) from a plain or parallel Llama: ``plait.generate``."""

from __future__ import annotations

import sys

from plait.generate.decode import Decoder, Sampling, generate_ids, sample

__all__ = ["Decoder", "Sampling", "generate", "generate_ids", "sample"]


def generate(model, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, seed: int = 0,
             tokenizer=None):
    """Continue each prompt (a string, or a list of token ids) with ``max_new_tokens`` tokens.

    ``model`` is a ``plait.models.Llama`` or a ``ParallelModel`` (then every rank calls this and gets the
    same result). Strings are encoded with ``tokenizer`` (UTF-8 bytes by default) and the continuations
    are returned decoded; id lists give id lists. Greedy when ``temperature == 0``.
    """
    from plait.train.data import ByteTokenizer

    single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
    batch = [prompts] if single else list(prompts)
    texts = bool(batch) and isinstance(batch[0], str)
    tok = tokenizer or ByteTokenizer()
    ids = [tok.encode(p) for p in batch] if texts else [list(map(int, p)) for p in batch]
    out = generate_ids(model, ids, Sampling(max_new_tokens, temperature, top_k, seed))
    result = [tok.decode(o) for o in out] if texts else out
    return result[0] if single else result


class _CallableModule(sys.modules[__name__].__class__):
    """``plait.generate(...)`` calls :func:`generate` (the package is also importable as a module)."""

    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
