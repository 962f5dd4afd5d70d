"""Test helpers for prepared data: a small BPE tokenizer trained here (nothing downloaded) and text corpora."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS = "<|endoftext|>"
WORDS = ("the parallel pipeline stage sends activations while tensor shards reduce gradients over data "
         "replicas and experts route tokens by top k gates { } [ ] \" : , naïve café 東京 ✓").split()


def documents(n: int, seed: int = 0, max_words: int = 60) -> list[str]:
    """``n`` varied documents (multi-byte characters, JSON-looking punctuation, newlines)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(1, max_words))) + ("\n" if i % 3 == 0 else "")
            for i in range(n)]


def bpe_folder(folder: Path, vocab_size: int = 400) -> Path:
    """A byte-level BPE ``tokenizer.json`` (and a tokenizer_config.json naming its EOS) trained on ``documents``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents(300, seed=1), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return folder


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d, "url": f"https://example.com/{i}"}) + "\n")
    return path
