"""Every rank's part of a serving step: paged KV caches, row groups through the stages, the last stage's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from plait.devices import to_device
from plait.errors import comm_wait
from plait.generation.decode import Decoder
from plait.generation.wavefront import Links, wavefront_order
from plait.parallel_model import ParallelModel
from plait.serve.kv import PagedBatch, PagedKVCache
from plait.serve.sampling import Params, SeqState, logprobs
from plait.tensor_parallel.loss import full_logits


@dataclass
class Row:
    """One sequence's work in a step: feed ``tokens`` at positions ``start``... through its block ``table``.

    ``sample``: the chunk reaches the end of the known tokens, so its last position gives the next token.
    ``targets``: the prompt tokens that follow the first ``len(targets)`` positions, whose log-probabilities
    are wanted (echo).
    """

    rid: int
    tokens: list[int]
    start: int
    table: list[int]
    sample: bool
    targets: list[int] = field(default_factory=list)


@dataclass
class Step:
    """One engine step, the same object on every rank: sequences to forget, new sequences' sampling, rows to run."""

    free: list[int] = field(default_factory=list)
    new: list[tuple[int, Params]] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    stop: bool = False

    @property
    def busy(self) -> bool:
        return bool(self.free or self.rows)


class Runner:
    """This rank's blocks with paged KV caches; ``execute(step)`` runs one step, rank 0 gets each row's outputs.

    A step (the same object on every rank, broadcast by rank 0) forgets finished sequences, registers new
    ones (their sampling ``Params``) and lists the step's rows: prompt chunks (grouped, padded; see ``groups``) and
    one-token rows (split into up to ``pp`` groups). Groups flow through the pipeline as a wavefront: while stage 1
    works on group 0, stage 0 already works on group 1. The last stage samples each row with that
    sequence's own generator (seeded from its seed), so a sequence's tokens do not depend on what else
    shares its batch, and computes the requested log-probabilities on the vocabulary-sharded logits.
    """

    def __init__(self, model: nn.Module | ParallelModel, num_blocks: int, block_size: int):
        self.dec = Decoder(model)
        self.ctx = self.dec.ctx
        self.batch = PagedBatch(block_size, self.dec.device, num_blocks)
        self.caches = self.dec.new_caches(lambda: PagedKVCache(num_blocks, block_size, self.batch))
        self.mine = sorted(self.dec.chunks)
        self.last = self.dec.num_chunks - 1
        self.pp = self.ctx.pp_size if self.ctx is not None else 1
        self.tp_group = self.ctx.tp_group if self.ctx is not None and self.ctx.tp_size > 1 else None
        self.seqs: dict[int, SeqState] = {}
        self.src = 0 if self.ctx is None else self.ctx.global_rank(tp_rank=0, dp_rank=0,
                                                                    pp_rank=self.dec.rank_of(self.last))

    def groups(self, rows: list[Row]) -> list[list[int]]:
        """Row indices of each group (one forward each): the multi-token rows, longest first, in groups padded to
        their longest row where the padding does not exceed the real tokens; then the one-token rows in <= pp
        groups.

        Prompt chunks that share a forward cost one pass through the model instead of one each (host-bound on a
        GPU, a pass costs about the same at any width), and chunks of one length need no padding at all.
        """
        chunks = sorted((i for i, r in enumerate(rows) if len(r.tokens) > 1), key=lambda i: -len(rows[i].tokens))
        out: list[list[int]] = []
        real = 0
        for i in chunks:
            n = len(rows[i].tokens)
            if out and (len(out[-1]) + 1) * len(rows[out[-1][0]].tokens) <= 2 * (real + n):
                out[-1].append(i)
                real += n
            else:
                out.append([i])
                real = n
        single = [i for i, r in enumerate(rows) if len(r.tokens) == 1]
        n = min(self.pp, len(single))
        return out + [single[g::n] for g in range(n)]

    @torch.no_grad()
    def execute(self, step: Step) -> list | None:
        """Run one ``step``; on rank 0 the outputs of each row (token, its logprobs, prompt logprobs)."""
        for rid in step.free:
            self.seqs.pop(rid, None)
        if self.last in self.mine:
            for rid, params in step.new:
                self.seqs[rid] = SeqState(params, self.dec.vocab, self.dec.device)
        rows = step.rows
        if not rows:
            return None
        outputs = self._pipeline(rows, self.groups(rows))
        if self.ctx is None or self.src == 0:
            return outputs if self.ctx is None or self.ctx.rank == 0 else None
        box, timeout_s = [outputs], self.ctx.timeout_s
        if self.ctx.rank == self.src:
            comm_wait(lambda: dist.send_object_list(box, dst=0), "sending the step's outputs to global rank 0", None,
                      timeout_s, me="serve: the last pipeline stage")
        elif self.ctx.rank == 0:
            comm_wait(lambda: dist.recv_object_list(box, src=self.src), "the step's outputs", self.src, timeout_s,
                      me="serve: rank 0")
            return box[0]
        return None

    def _pipeline(self, rows: list[Row], groups: list[list[int]]) -> list | None:
        """Groups through this rank's chunks in wavefront order (tick = group + chunk); outputs on the last stage."""
        links = Links(self.dec)
        outputs: list = [None] * len(rows)
        for c, g, _p in wavefront_order(self.mine, len(groups)):
            part = [rows[i] for i in groups[g]]
            lengths = [len(r.tokens) for r in part]
            s = max(lengths)  # the group's rows are padded (with token 0) to its longest
            tables, starts = [r.table for r in part], [r.start for r in part]
            n = len(part)
            if s == 1:  # one-token rows: padding rows up to the batch's row count (a few shapes; see PagedBatch)
                table, start, length = self.batch.padding_row()
                pad = self.batch.row_count(n) - n
                tables, starts, lengths = tables + [table] * pad, starts + [start] * pad, lengths + [length] * pad
            if c == 0:
                x = to_device(torch.tensor([r.tokens + [0] * (s - len(r.tokens)) for r in part]
                                           + [[0] * s] * (len(lengths) - n), dtype=torch.long), self.dec.device)
            else:
                x = links.take(c, (g,), len(lengths), s)
            self.batch.set(tables, starts, None if min(lengths) == s else lengths)
            x = self.dec.run(c, x, self.caches)
            if c == self.last:
                for i, out in zip(groups[g], self._outputs(x[:n], part), strict=True):
                    outputs[i] = out
            else:
                links.give(c, (g,), x)
        links.wait()
        return outputs if self.last in self.mine else None

    def _outputs(self, x: torch.Tensor, rows: list[Row]) -> list[tuple]:
        """(token or None, (logprob, top) or None, prompt [(logprob, top)] or None) of each row from logits x."""
        states = [self.seqs[r.rid] for r in rows]
        for r, st in zip(rows, states, strict=True):
            st.see_prompt(r.tokens)
        tokens: list[int | None] = [None] * len(rows)
        pick = [i for i, r in enumerate(rows) if r.sample]
        if pick:
            ends = [len(rows[i].tokens) - 1 for i in pick]  # each row's last real position (padding follows)
            # every row at the forward's last position (a decode step): a slice, no index tensors sent over
            every = len(pick) == len(rows) and min(ends) == x.shape[1] - 1
            last = full_logits(x[:, -1] if every else x[pick, ends], self.ctx, self.dec.vocab)  # [n, V]
            plain = [j for j, i in enumerate(pick) if states[i].argmax_as_is]
            if plain:  # one argmax and one read of the device for all of them, not one per row
                greedy = last if len(plain) == len(pick) else last[plain]
                for j, tok in zip(plain, greedy.argmax(-1).tolist(), strict=True):
                    tokens[pick[j]] = states[pick[j]].took(tok)
            for j, i in enumerate(pick):
                if tokens[i] is None:
                    tokens[i] = states[i].next_token(last[j])
        return self._logprobs(x, rows, states, tokens)

    def _logprobs(self, x: torch.Tensor, rows: list[Row], states: list[SeqState], tokens: list) -> list[tuple]:
        """The requested log-probabilities, one ``logprobs`` call (one set of TP collectives) for the whole group."""
        zs, targets, spans = [], [], []  # spans: (row, kind, count, k)
        for i, (r, st) in enumerate(zip(rows, states, strict=True)):
            p: Params = st.params
            if r.targets:
                zs.append(x[i, : len(r.targets)])
                targets += r.targets
                spans.append((i, "prompt", len(r.targets), p.prompt_logprobs or 0))
            if tokens[i] is not None and p.logprobs is not None:
                zs.append(x[i, len(r.tokens) - 1: len(r.tokens)])
                targets.append(tokens[i])
                spans.append((i, "token", 1, p.logprobs))
        out = [[tok, None, None] for tok in tokens]
        if not zs:
            return [tuple(o) for o in out]
        k = max(s[3] for s in spans)
        lp, top_ids, top_lp = logprobs(torch.cat(zs), torch.tensor(targets, dtype=torch.long, device=x.device), k,
                                       self.tp_group, self.dec.vocab)
        lp, top_ids, top_lp = lp.tolist(), top_ids.tolist(), top_lp.tolist()
        at = 0
        for i, kind, n, kk in spans:
            vals = [(lp[j], list(zip(top_ids[j][:kk], top_lp[j][:kk], strict=True))) for j in range(at, at + n)]
            at += n
            if kind == "prompt":
                out[i][2] = vals
            else:
                out[i][1] = vals[0]
        return [tuple(o) for o in out]
