"""Autoregressive decoding with KV caches kept by the rank that owns each layer, under any TP x PP layout.

Stages run one after the other for each step (prefill, then one token at a time): the rank holding
chunk ``c`` receives the hidden states of chunk ``c - 1``, runs its blocks (each decoder layer with its
own ``KVCache``), and sends on; the last stage gathers the vocabulary-sharded logits of the last position
over TP, samples, and broadcasts the tokens to its pipeline peers. Sampling uses one seeded generator in
the same order in every layout, so any layout gives the tokens one device gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from plait.errors import ConfigError
from plait.models.llama import KVCache, Llama
from plait.tensor_parallel import comms


@dataclass
class Sampling:
    """Greedy when ``temperature == 0``; otherwise softmax(logits / T), restricted to the ``top_k`` best if > 0."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def check(self) -> None:
        if self.max_new_tokens < 0 or self.temperature < 0 or self.top_k < 0:
            raise ConfigError("max_new_tokens, temperature and top_k must be >= 0")


def sample(logits: torch.Tensor, s: Sampling, gen: torch.Generator) -> torch.Tensor:
    """Next tokens [B] from last-position logits [B, V] (float64 for layout-independent ties)."""
    logits = logits.double()
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if s.top_k > 0:
        kth = logits.topk(min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits.device)


class Decoder:
    """This rank's blocks of a (possibly parallel) Llama, run step by step with KV caches."""

    def __init__(self, model):
        from plait.parallel_model import ParallelModel
        from plait.pipeline.partition import model_blocks

        if isinstance(model, ParallelModel):
            self.ctx, self.vocab = model.ctx, model.vocab_size
            self.chunks = {c: list(zip(ch.names, ch.blocks, strict=True)) for c, ch in model.chunks.items()}
            self.num_chunks = model.schedule.num_stages
            self.rank_of = model.schedule.stage_to_rank
            self.device = model.ctx.device
            self.dtype = next(model.parameters()).dtype
        elif isinstance(model, Llama):
            self.ctx, self.vocab = None, model.config.vocab_size
            self.chunks = {0: model_blocks(model)[0]}
            self.num_chunks, self.rank_of = 1, lambda c: 0
            p = next(model.parameters())
            self.device, self.dtype = p.device, p.dtype
        else:
            raise ConfigError(f"generate needs a plait.models.Llama or a ParallelModel, not {type(model).__name__}")
        self.caches: dict[str, KVCache] = {}

    @property
    def me(self) -> int:
        return self.ctx.pp_rank if self.ctx is not None else 0

    def reset(self) -> None:
        self.caches = {name: KVCache() for blocks in self.chunks.values() for name, _ in blocks
                       if name.startswith("layers.")}

    def _run(self, c: int, x: torch.Tensor) -> torch.Tensor:
        for name, block in self.chunks[c]:
            x = block(x, cache=self.caches[name]) if name in self.caches else block(x)
        return x

    def _peer(self, c: int) -> int:
        return self.ctx.pp_peer(self.rank_of(c))

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, hidden_dim: int) -> torch.Tensor | None:
        """Run ``tokens`` [B, S] through every stage; the last-position logits [B, V] on the last stage."""
        x: torch.Tensor | None = tokens.to(self.device)
        b, s = tokens.shape
        for c in range(self.num_chunks):
            owner = self.rank_of(c)
            if owner != self.me:
                x = None
                continue
            if c > 0 and self.rank_of(c - 1) != self.me:
                x = torch.empty(b, s, hidden_dim, dtype=self.dtype, device=self.device)
                dist.recv(x, src=self._peer(c - 1))
            x = self._run(c, x)
            if c < self.num_chunks - 1 and self.rank_of(c + 1) != self.me:
                dist.send(x.contiguous(), dst=self._peer(c + 1))
        if self.rank_of(self.num_chunks - 1) != self.me:
            return None
        last = x[:, -1]  # [B, V/t] (vocabulary-sharded under TP)
        if self.ctx is not None and self.ctx.tp_size > 1:
            last = comms.all_gather(last.contiguous(), 1, self.ctx.tp_group)
        return last[:, : self.vocab]

    def share(self, tokens: torch.Tensor | None, batch: int) -> torch.Tensor:
        """Broadcast sampled tokens [B] from the last stage to every pipeline rank."""
        if self.ctx is None or self.ctx.pp_size == 1:
            return tokens
        buf = tokens if tokens is not None else torch.empty(batch, dtype=torch.long, device=self.device)
        dist.broadcast(buf, src=self._peer(self.num_chunks - 1), group=self.ctx.pp_group)
        return buf


def _hidden_dim(dec: Decoder) -> int:
    """The model width, from a norm this rank holds (every rank holds at least one decoder layer)."""
    for blocks in dec.chunks.values():
        for _name, block in blocks:
            norm = getattr(block, "input_layernorm", None)
            if norm is not None:
                return norm.weight.shape[0]
    raise ConfigError("this rank holds no decoder layer")


def generate_ids(model, prompts: list[list[int]], s: Sampling, max_seq_len: int | None = None) -> list[list[int]]:
    """New token ids for each prompt (the same on every rank). Prompts may differ in length."""
    s.check()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token")
    dec = Decoder(model)
    dim = _hidden_dim(dec)
    lengths = [len(p) for p in prompts]
    total = max(lengths) + s.max_new_tokens
    if max_seq_len is not None and total > max_seq_len:
        raise ConfigError(f"prompt + max_new_tokens = {total} exceeds the model's max_seq_len {max_seq_len}")
    buf = torch.zeros(len(prompts), total, dtype=torch.long)
    is_prompt = torch.zeros_like(buf, dtype=torch.bool)
    for i, p in enumerate(prompts):
        buf[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        is_prompt[i, : len(p)] = True
    gen = torch.Generator().manual_seed(s.seed)
    dec.reset()
    pos = min(lengths)
    logits = dec.step(buf[:, :pos], dim)  # prefill the common prefix
    while pos < total:
        nxt = sample(logits, s, gen).cpu() if logits is not None else None
        nxt = dec.share(nxt.to(dec.device) if nxt is not None else None, len(prompts)).cpu()
        buf[:, pos] = torch.where(is_prompt[:, pos], buf[:, pos], nxt)  # rows still in their prompt keep it
        pos += 1
        if pos < total:
            logits = dec.step(buf[:, pos - 1:pos], dim)
    return [buf[i, n: n + s.max_new_tokens].tolist() for i, n in enumerate(lengths)]

