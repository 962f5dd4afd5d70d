"""What the server tells about its tokenizer: special tokens of the model folder, /tokenize and /tokenizer_info."""

from __future__ import annotations

import json
from pathlib import Path

# the chat template of plait.serve.protocol.chat_prompt, as a Jinja template (for clients that render it)
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _text(value) -> str | None:
    """A special token of tokenizer_config.json: a string or {"content": string}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TokenizerInfo:
    """The end-of-sequence ids (generation_config.json, else config.json) and special tokens of a model folder."""

    def __init__(self, tok, folder: str, context: int):
        path = Path(folder)
        gen, cfg, tcfg = (_read(path / name) for name in
                          ("generation_config.json", "config.json", "tokenizer_config.json"))
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        self.eos: tuple[int, ...] = tuple(eos) if isinstance(eos, list) else () if eos is None else (int(eos),)
        self.tok, self.context = tok, context
        self.special = {name: _text(tcfg.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.leading = tok.encode("")  # what the tokenizer adds to every text (a BOS), if anything

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; without the special tokens the tokenizer adds in front when asked."""
        ids = self.tok.encode(text)
        n = len(self.leading)
        if not add_special_tokens and n and ids[:n] == self.leading:
            ids = ids[n:]
        return ids

    def info(self) -> dict:
        """GET /tokenizer_info: the tokenizer's class, special tokens, context and chat template (as vLLM)."""
        return {"tokenizer_class": type(self.tok).__name__, **self.special, "model_max_length": self.context,
                "chat_template": CHAT_TEMPLATE}
