"""A sequence's generated text, token by token: incremental detokenisation and stop strings cut exactly."""

from __future__ import annotations

from plait.tokenizers import after_prompt


class TextTracker:
    """The text of the tokens pushed so far, released as deltas; a stop string ends it (cut before the stop).

    Each push decodes only a short window of recent tokens (the text of ``ids[prefix:]`` minus that of
    ``ids[prefix:read]``), so the cost per token does not grow with the output, and an incomplete UTF-8
    sequence (text ending in U+FFFD) is held back until the token that completes it. With stop strings,
    the last ``len(longest stop) - 1`` characters are held back too, since they may begin a stop string;
    ``flush`` releases them when the sequence ends for another reason. The first tokens are decoded after the
    last few of ``prompt`` (plait.tokenizers.after_prompt), so the text keeps the space a tokenizer drops at the
    start of what it decodes.
    """

    def __init__(self, tok, stops: list[str] | None = None, include_stop: bool = False,
                 prompt: list[int] | None = None):
        self.tok = tok
        self.stops = [s for s in (stops or []) if s]
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = after_prompt(tok, prompt or [])
        self.prefix, self.read = 0, len(self.ids)  # ids[prefix:read] were decoded already; ids[read:] not yet
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of ``text`` released
        self.stopped: str | None = None  # the stop string that ended the text

    def push(self, tok_id: int, check: bool = True) -> str:
        """Add one token; the newly released text (empty while held back or after a stop); ``check``: look for stops."""
        if self.stopped is not None:
            return ""
        self.ids.append(tok_id)
        before = self.tok.decode(self.ids[self.prefix: self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if now.endswith("\ufffd") or len(now) <= len(before):
            return ""  # an incomplete character: wait for the next token
        self.text += now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return self._release(check)

    def _release(self, check: bool) -> str:
        if self.stops and check:
            start = max(0, self.sent - self.hold)  # a stop may straddle what was released and what is new
            found = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
            if found:
                i, stop = min(found)
                self.stopped = stop
                end = i + len(stop) if self.include_stop else i
                return self._upto(max(end, self.sent))
        return self._upto(max(self.sent, len(self.text) - self.hold) if self.stops else len(self.text))

    def _upto(self, end: int) -> str:
        delta, self.sent = self.text[self.sent: end], end
        return delta

    def flush(self) -> str:
        """The held-back text, when the sequence ends without a stop string (an incomplete character included)."""
        if self.stopped is not None:
            return ""
        tail = self.tok.decode(self.ids[self.prefix:])
        self.text += tail[len(self.tok.decode(self.ids[self.prefix: self.read])):]
        self.prefix = self.read = len(self.ids)
        return self._upto(len(self.text))


def before_stop(text: str, stops: list[str]) -> str:
    """``text`` up to the first of the ``stops`` strings it holds (all of it when it holds none): a whole
    continuation cut as a TextTracker cuts it token by token."""
    found = [i for s in stops if s and (i := text.find(s)) >= 0]
    return text[:min(found)] if found else text
