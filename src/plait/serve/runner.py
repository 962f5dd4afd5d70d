"""Every rank's part of a serving step: slot KV caches, prefill/decode groups flowing through the stages, sampling."""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.generate.decode import Decoder, Sampling, _hidden_dim, sample
from plait.generate.wavefront import Links, wavefront_order
from plait.models.llama import BatchKVCache
from plait.tensor_parallel import comms


class Runner:
    """This rank's blocks with slot-based KV caches; ``execute(plan)`` runs one step and returns its tokens.

    A plan (the same object on every rank, broadcast by rank 0) frees slots, prefills newly admitted
    requests (one group each) and decodes one token for every running slot (the running slots split into
    up to ``pp`` groups). Groups flow through the pipeline as a wavefront: while stage 1 works on group 0,
    stage 0 already works on group 1, so the stages are busy at the same time. The last stage samples each
    row with that request's own generator (seeded from its seed), so a request's tokens do not depend on
    what else shares its batch; the tokens are then broadcast to every rank.
    """

    def __init__(self, model, max_batch: int, max_len: int):
        self.dec = Decoder(model)
        self.ctx = self.dec.ctx
        self.dim = _hidden_dim(self.dec)
        self.dec.caches = {name: BatchKVCache(max_batch, max_len) for blocks in self.dec.chunks.values()
                           for name, _ in blocks if name.startswith("layers.")}
        self.chunk_caches = {c: [self.dec.caches[n] for n, _ in blocks if n in self.dec.caches]
                             for c, blocks in self.dec.chunks.items()}
        self.mine = sorted(self.dec.chunks)
        self.last = self.dec.num_chunks - 1
        self.pp = self.ctx.pp_size if self.ctx is not None else 1
        self.gens: dict[int, torch.Generator] = {}
        self.sampling: dict[int, Sampling] = {}
        self.src = 0 if self.ctx is None else self.ctx.global_rank(tp_rank=0, dp_rank=0,
                                                                    pp_rank=self.dec.rank_of(self.last))

    def groups(self, plan: dict) -> list[tuple[list[int], torch.Tensor]]:
        """(slots, input tokens [b, s]) of each group: one per prefill, then the decode rows in <= pp groups."""
        out = [([slot], torch.tensor([ids], dtype=torch.long)) for slot, ids, _ in plan["prefill"]]
        decode = plan["decode"]
        n = min(self.pp, len(decode))
        for g in range(n):
            part = decode[g::n]
            out.append(([s for s, _ in part], torch.tensor([[t] for _, t in part], dtype=torch.long)))
        return out

    @torch.no_grad()
    def execute(self, plan: dict) -> list[int]:
        """Run one step of ``plan``; the sampled token of every row (prefill rows first), on every rank."""
        for slot in plan["free"]:
            for cache in self.dec.caches.values():
                cache.free(slot)
            self.gens.pop(slot, None)
            self.sampling.pop(slot, None)
        for slot, _ids, s in plan["prefill"]:
            self.sampling[slot] = Sampling(*s)
            self.gens[slot] = torch.Generator().manual_seed(self.sampling[slot].seed)
        groups = self.groups(plan)
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
        links = Links(self.dec, self.dim)
        sampled: dict[int, torch.Tensor] = {}
        for c, g, _p in wavefront_order(self.mine, len(groups)):
            slots, toks = groups[g]
            x = toks.to(self.dec.device) if c == 0 else links.take(c, (g,), toks.shape[0], toks.shape[1])
            rows = torch.tensor(slots, dtype=torch.long)
            for cache in self.chunk_caches[c]:
                cache.rows = rows
            x = self.dec._run(c, x)
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
        last = x[:, -1]  # [b, V/t]
        if self.ctx is not None and self.ctx.tp_size > 1:
            last = comms.all_gather(last.contiguous(), 1, self.ctx.tp_group)
        last = last[:, : self.dec.vocab]
        return torch.cat([sample(last[i: i + 1], self.sampling[s], self.gens[s]).cpu() for i, s in enumerate(slots)])
