"""OpenAI response bodies: one choice's text, tokens and log-probabilities, whole or as streamed chunks, and usage."""

from __future__ import annotations

import time
import uuid

from plait.serve.protocol import Parsed
from plait.tokenizers import CONTEXT_TOKENS, continuation


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def envelope(p: Parsed, rid: str, model: str, choices: list[dict], chunk: bool) -> dict:
    kind = ("chat.completion" if p.chat else "text_completion") + (".chunk" if chunk and p.chat else "")
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}


def usage(p: Parsed, completion_tokens: int) -> dict:
    n_prompt = sum(len(x) for x in p.prompts)
    return {"prompt_tokens": n_prompt, "completion_tokens": completion_tokens,
            "total_tokens": n_prompt + completion_tokens}


class Choice:
    """One choice of a response, fed the engine's events; ``token_ids`` (and ``prompt_token_ids`` with echo) are
    plait extras beside the OpenAI fields.

    Log-probabilities: completions give {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (with echo
    the prompt's tokens first, the first of them null, as vLLM); chat gives {"content": [{"token", "logprob",
    "bytes", "top_logprobs"}]}. Each top list holds the ``k`` most likely tokens and the token itself.
    """

    def __init__(self, p: Parsed, index: int, prompt: list[int], tok):
        self.p, self.index, self.prompt, self.tok = p, index, prompt, tok
        self.want = p.params.logprobs is not None
        self.ids: list[int] = []
        self.lps: list = []  # (logprob, top) of each generated token
        self.prompt_lps: list = []
        self.text = ""
        self.finish: str | None = None
        self.echoed = False
        self.sent = 0  # characters of token strings streamed so far (text_offset of the next token)

    def feed(self, ev: dict) -> dict | None:
        """Take one event; the streamed choice chunk it makes (None for prompt log-probabilities)."""
        if ev["type"] == "prompt":
            self.prompt_lps += ev["logprobs"]
            return None
        head = self._echo() if self.p.echo and not self.echoed else ("", [], [])
        self.echoed = True
        if ev["type"] == "token":
            self.ids.append(ev["id"])
            self.lps.append(ev["logprob"])
            self.text += ev["text"]
            text, ids, lps = ev["text"], [ev["id"]], [ev["logprob"]]
        else:
            self.finish = ev["finish_reason"]
            self.text += ev["text"]
            text, ids, lps = ev["text"], [], []
        before = [] if head[1] else self.prompt + self.ids[:len(self.ids) - len(ids)]
        return self._choice(head[0] + text, head[1] + ids, head[2] + lps, self.finish, True, before)

    def _echo(self) -> tuple[str, list[int], list]:
        return self.tok.decode(self.prompt), list(self.prompt), [None, *self.prompt_lps]

    def final(self) -> dict:
        head = self._echo() if self.p.echo else ("", [], [])
        choice = self._choice(head[0] + self.text, head[1] + self.ids, head[2] + self.lps, self.finish, False,
                              [] if self.p.echo else self.prompt)
        if self.p.echo:
            choice["prompt_token_ids"] = list(self.prompt)
            choice["token_ids"] = list(self.ids)
        return choice

    def _choice(self, text: str, ids: list[int], lps: list, finish: str | None, delta: bool,
                before: list[int]) -> dict:
        """``ids``: the tokens of this chunk (or of the whole choice), which ``before`` precede."""
        start = self.sent if delta else 0
        logprobs = self._logprobs(ids, lps, start, before) if self.want and (ids or not delta) else None
        if delta and self.want:
            self.sent += sum(len(w) for w in self._words(ids, before)[0])
        if not self.p.chat:
            return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                    "token_ids": ids}
        key = "delta" if delta else "message"
        msg = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": self.index, key: msg, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids}

    def _word(self, t: int, context: list[int]) -> str:
        """Token ``t``'s text where it stands, after the ids ``context``: the text it adds there (a SentencePiece
        word's leading space included), so a choice's token strings join into its text."""
        return f"token_id:{t}" if self.p.ids_as_tokens else continuation(self.tok, context, [t])

    def _words(self, ids: list[int], before: list[int]) -> tuple[list[str], list[list[int]]]:
        """The text of each of ``ids`` where it stands, and the ids before each (its last CONTEXT_TOKENS)."""
        full, k = before + ids, len(before)
        contexts = [full[max(0, k + j - CONTEXT_TOKENS): k + j] for j in range(len(ids))]
        return [self._word(t, c) for t, c in zip(ids, contexts, strict=True)], contexts

    def _logprobs(self, ids: list[int], lps: list, start: int, before: list[int]) -> dict:
        words, contexts = self._words(ids, before)
        if self.p.chat:
            return {"content": [{**self._entry(w, t, lp[0]),
                                 "top_logprobs": [self._entry(self._word(a, c), a, v) for a, v in lp[1]]}
                                for w, t, c, lp in zip(words, ids, contexts, lps, strict=True)]}
        offsets = []
        for w in words:
            offsets.append(start)
            start += len(w)
        tops = [None if lp is None else {**{self._word(a, c): v for a, v in lp[1]}, w: lp[0]}
                for w, c, lp in zip(words, contexts, lps, strict=True)]
        return {"tokens": words, "token_logprobs": [None if lp is None else lp[0] for lp in lps],
                "top_logprobs": tops, "text_offset": offsets}

    def _entry(self, word: str, t: int, logprob: float) -> dict:
        """A chat log-probability entry; its ``bytes`` are the token's own (a piece of a character's UTF-8 that
        only the tokens after it complete: not the replacement character its text shows)."""
        raw = self.tok.token_bytes(t) if "\ufffd" in word and not self.p.ids_as_tokens else word.encode()
        return {"token": word, "logprob": logprob, "bytes": list(raw)}
