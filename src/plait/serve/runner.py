"""Every rank's part of a serving step: slot KV caches, prefill/decode groups flowing through the stages, sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from plait.generation.decode import Decoder, Sampling, sample
from plait.generation.wavefront import Links, wavefront_order
from plait.models.llama import BatchKVCache
from plait.parallel_model import ParallelModel


@dataclass
class Prefill:
    """A newly admitted request: its KV slot, prompt ids and sampling settings."""

    slot: int
    prompt: list[int]
    sampling: Sampling


@dataclass
class Decode:
    """A running request: its KV slot and the last token it produced (the next input)."""

    slot: int
    token: int


@dataclass
class Step:
    """One engine step, the same object on every rank: slots to free, requests to prefill, rows to decode."""

    free: list[int] = field(default_factory=list)
    prefill: list[Prefill] = field(default_factory=list)
    decode: list[Decode] = field(default_factory=list)
    stop: bool = False

    @property
    def busy(self) -> bool:
        return bool(self.free or self.prefill or self.decode)


class Runner:
    """This rank's blocks with slot-based KV caches; ``execute(step)`` runs one step and returns its tokens.

    A step (the same object on every rank, broadcast by rank 0) frees slots, prefills newly admitted
    requests (one group each) and decodes one token for every running slot (the running slots split into
    up to ``pp`` groups). Groups flow through the pipeline as a wavefront: while stage 1 works on group 0,
    stage 0 already works on group 1, so the stages are busy at the same time. The last stage samples each
    row with that request's own generator (seeded from its seed), so a request's tokens do not depend on
    what else shares its batch; the tokens are then broadcast to every rank.
    """

    def __init__(self, model: nn.Module | ParallelModel, max_batch: int, max_len: int):
        self.dec = Decoder(model)
        self.ctx = self.dec.ctx
        self.caches: dict[str, BatchKVCache] = self.dec.new_caches(lambda: BatchKVCache(max_batch, max_len))
        self.chunk_caches = {c: [self.caches[n] for n, _ in blocks if n in self.caches]
                             for c, blocks in self.dec.chunks.items()}
        self.mine = sorted(self.dec.chunks)
        self.last = self.dec.num_chunks - 1
        self.pp = self.ctx.pp_size if self.ctx is not None else 1
        self.gens: dict[int, torch.Generator] = {}
        self.sampling: dict[int, Sampling] = {}
        self.src = 0 if self.ctx is None else self.ctx.global_rank(tp_rank=0, dp_rank=0,
                                                                    pp_rank=self.dec.rank_of(self.last))

    def groups(self, step: Step) -> list[tuple[list[int], torch.Tensor]]:
        """(slots, input tokens [b, s]) of each group: one per prefill, then the decode rows in <= pp groups."""
        out = [([p.slot], torch.tensor([p.prompt], dtype=torch.long)) for p in step.prefill]
        decode = step.decode
        n = min(self.pp, len(decode))
        for g in range(n):
            part = decode[g::n]
            out.append(([d.slot for d in part], torch.tensor([[d.token] for d in part], dtype=torch.long)))
        return out

    @torch.no_grad()
    def execute(self, step: Step) -> list[int]:
        """Run one ``step``; the sampled token of every row (prefill rows first), on every rank."""
        for slot in step.free:
            for cache in self.caches.values():
                cache.free(slot)
            self.gens.pop(slot, None)
            self.sampling.pop(slot, None)
        for p in step.prefill:
            self.sampling[p.slot] = p.sampling
            self.gens[p.slot] = torch.Generator().manual_seed(p.sampling.seed)
        groups = self.groups(step)
        if not groups:
            return []
        tokens = self._pipeline(groups)
        rows = sum(len(slots) for slots, _ in groups)
        if self.ctx is None:
            return tokens.tolist()
        buf = tokens if tokens is not None else torch.empty(rows, dtype=torch.long)
        dist.broadcast(buf, src=self.src)
        return buf.tolist()

    def _pipeline(self, groups: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor | None:
        """Groups through this rank's chunks in wavefront order (tick = group + chunk); tokens on the last stage."""
        links = Links(self.dec)
        sampled: dict[int, torch.Tensor] = {}
        for c, g, _p in wavefront_order(self.mine, len(groups)):
            slots, toks = groups[g]
            x = toks.to(self.dec.device) if c == 0 else links.take(c, (g,), toks.shape[0], toks.shape[1])
            rows = torch.tensor(slots, dtype=torch.long)
            for cache in self.chunk_caches[c]:
                cache.rows = rows
            x = self.dec.run(c, x, self.caches)
            if c == self.last:
                sampled[g] = self._sample(x, slots)
            else:
                links.give(c, (g,), x)
        links.wait()
        if self.last not in self.mine:
            return None
        return torch.cat([sampled[g] for g in range(len(groups))])

    def _sample(self, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Next token [b] of each row from the last-position logits (gathered over TP), each with its own generator."""
        last = self.dec.full_logits(x)  # [b, V]
        return torch.cat([sample(last[i: i + 1], self.sampling[s], self.gens[s]).cpu() for i, s in enumerate(slots)])
