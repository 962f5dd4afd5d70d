"""What ``plait data prepare`` shows: a progress bar (MB/s, tokens/s, ETA) and the summary table."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

from plait.data.skipped import EXAMPLES, tally
from plait.words import counted

#: without an interactive console (output to a file, a pipe, a batch job's log): a progress line this often
LINE_EVERY_S = 30.0


class _Bar:
    """Advances a rich progress bar by each finished task's input bytes, with the speed, tokens and time left
    counted from the start (a task's bytes arrive at once when it ends: a rate over the last moments would read
    a chunk's megabytes over milliseconds); without a bar, prints a line every LINE_EVERY_S seconds to
    ``console`` (when there is one)."""

    def __init__(self, progress, task, console=None, total: int = 0):
        self.progress, self.task, self.tokens, self.t0 = progress, task, 0, time.perf_counter()
        self.console, self.total, self.done, self.shown = console, total, 0, self.t0

    def advance(self, result) -> None:
        self.tokens += int(sum(n.sum() for n in result.lengths.values()))
        self.done += result.nbytes
        now = time.perf_counter()
        speed = self.done / max(1e-9, now - self.t0)
        left = f"about {_duration((self.total - self.done) / max(speed, 1e-9))} left"
        if self.progress is not None:  # short: the bar's other columns keep their width in 80 columns
            rate = self.tokens / max(1e-9, now - self.t0)
            per_s = f"{rate / 1e6:.1f}M" if rate >= 1e6 else f"{rate / 1e3:.0f}k"
            self.progress.update(self.task, advance=result.nbytes,
                                 info=f"{speed / 1e6:,.1f} MB/s, {per_s} tok/s, {left.removeprefix('about ')}")
        elif self.console is not None and now - self.shown >= LINE_EVERY_S and self.done < self.total:
            self.shown = now
            self.console.print(f"prepare: {self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB "
                               f"({self.done / max(1, self.total):.0%}), {self.tokens:,} tokens, "
                               f"{speed / 1e6:,.1f} MB/s, {left}",
                               soft_wrap=True)  # one line of the log each, whatever the console's width


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min" if seconds < 5400 else \
        f"{seconds / 3600:.1f} h"


@contextmanager
def prepare_progress(console, total_bytes: int, doing: str = "tokenizing"):
    """A bar over the sources' bytes on an interactive console, saying ``doing`` until the first task ends;
    otherwise a line every LINE_EVERY_S seconds."""
    if console is None or not console.is_terminal:
        yield _Bar(None, None, console, total_bytes)
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("[bold]prepare"), BarColumn(bar_width=20), DownloadColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[info]}"), console=console)
    task = progress.add_task("prepare", total=total_bytes, info=doing)
    with progress:
        yield _Bar(progress, task, total=total_bytes)


def prepare_summary(meta: dict, out: Path):
    """The sources and splits of a prepared dataset: a heading, a rich table and the notes below it (speed,
    shards, the chat rendering, skipped records). The heading and notes are lines of their own, wrapped at the
    console's width: as the table's title and caption they were wrapped at the table's, a few words a line."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    tok = meta["tokenizer"]
    heading = Text(f"plait data prepare: {out} ({tok['name']}, vocabulary {tok['vocab_size']:,}, EOS {tok['eos']}, "
                   f"{meta['dtype']})", style="table.title")
    t = Table()
    for name in ("source", "kind", "MB", "documents", "skipped", "tokens"):
        t.add_column(name, justify="left" if name in ("source", "kind") else "right")
    for s in meta["sources"]:
        t.add_row(s["path"], s["kind"], f"{s['bytes'] / 1e6:,.2f}", f"{s['documents']:,}", f"{s['skipped']:,}",
                  f"{s['tokens']:,}")
    for split, info in meta["splits"].items():
        t.add_row(f"[bold]{split}[/]", "", "", f"{info['documents']:,}", "", f"{info['tokens']:,}")
    mb = sum(s["bytes"] for s in meta["sources"]) / 1e6
    tokens = sum(info["tokens"] for info in meta["splits"].values())
    secs = max(meta["seconds"], 1e-9)
    notes = [f"{secs:.1f} s: {mb / secs:,.1f} MB/s, {tokens / secs:,.0f} tokens/s; "
             f"{counted(len(meta['splits']['train']['shards']), 'training shard')}"]
    chat = meta.get("chat")
    if chat is not None:
        train = meta["splits"]["train"]
        share = train["loss_tokens"] / max(1, train["tokens"])
        how = f" (by {chat['method']})" if chat.get("method") not in (None, "every token") else ""
        given = f" and variables {json.dumps(chat['template_kwargs'])}" if chat.get("template_kwargs") else ""
        notes.append(f"chat: {chat['messages_field']!r} rendered with {chat['template']}{given}; the loss on "
                     f"{chat['loss_on']} tokens{how}: {train['loss_tokens']:,} of the training split's "
                     f"{train['tokens']:,} ({share:.0%})")
    held, share = meta["splits"]["held_out"]["documents"], meta.get("held_out_fraction", 0)
    documents = held + meta["splits"]["train"]["documents"]
    if share > 0 and held == 0 and documents:  # the hash chose none: training would show no held-out loss
        notes.append(f"held_out: no document (the hash of each text chose none of {counted(documents, 'document')} at "
                     f"--held-out {share:g}, about {share * documents:.2g} expected): plait train --data shows no "
                     f"held-out loss; for one, prepare again with a larger --held-out (--force)")
    reasons = tally(s.get("skipped_reasons", {}) for s in meta["sources"])
    examples = [e for s in meta["sources"] for e in s.get("skipped_examples", [])]
    if examples:
        kinds = "; ".join(f"{n:,} {why}" for why, n in reasons.items())  # a why may hold a comma
        notes += [f"skipped ({kinds}), e.g.:" if kinds else "skipped, e.g.:"] + [f"  {e}" for e in examples[:EXAMPLES]]
    return Group(heading, t, Text("\n".join(notes), style="table.caption"))
