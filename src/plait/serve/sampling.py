"""The last stage's per-request sampling (penalties, logit bias, min_tokens) and log-probabilities on sharded logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.distributed.collectives import collective
from plait.generation.decode import Sampling, sample
from plait.tensor_parallel import comms


@dataclass
class Params:
    """What one sequence asks of the last stage: how to sample, what to penalise, which log-probabilities to give.

    ``logprobs``: None, or how many of the most likely tokens to report beside each sampled token's own
    log-probability (0: only its own); ``prompt_logprobs`` likewise for the prompt tokens (echo). ``banned``
    (end-of-sequence and stop token ids) cannot be sampled before ``min_tokens`` tokens were generated.
    """

    sampling: Sampling
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    banned: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class SeqState:
    """A sequence's sampling state on the last stage: its generator and the counts of the tokens it has seen."""

    def __init__(self, params: Params, vocab: int, device: torch.device) -> None:
        self.params = params
        self.gen = torch.Generator().manual_seed(params.sampling.seed)  # draws on the host (see ``sample``)
        self.generated = 0
        penalised, repeats = params.penalised, params.repetition_penalty != 1.0  # counts: of generated tokens
        self.counts = torch.zeros(vocab, dtype=torch.float64, device=device) if penalised else None
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device) if repeats else None

    def see_prompt(self, ids: list[int]) -> None:
        """Prompt tokens count for the repetition penalty (as in vLLM); fed once per prompt position."""
        if self.seen is not None and ids:
            self.seen[torch.tensor(ids, dtype=torch.long, device=self.seen.device)] = True

    @property
    def argmax_as_is(self) -> bool:
        """The next token is the argmax of the logits as they are: greedy, and no processor changes them."""
        p = self.params
        return (p.sampling.temperature == 0 and not p.logit_bias and self.counts is None and self.seen is None
                and not (p.banned and self.generated < p.min_tokens))

    def took(self, tok: int) -> int:
        """Record ``tok`` as this sequence's next token (drawn by ``next_token``, or the argmax the runner picked
        for a row that is ``argmax_as_is``): the count of generated tokens and the penalties' counts."""
        self.generated += 1
        if self.counts is not None:
            self.counts[tok] += 1
        if self.seen is not None:
            self.seen[tok] = True
        return tok

    def next_token(self, logits: torch.Tensor) -> int:
        """Sample from one row of full-vocabulary logits [V] (on this sequence's device) after its logits processors."""
        p = self.params
        z = logits.double()
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=z.device)
            z = z.index_add(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=torch.float64, device=z.device))
        if p.banned and self.generated < p.min_tokens:
            z = z.index_fill(0, torch.tensor(p.banned, dtype=torch.long, device=z.device), float("-inf"))
        if self.seen is not None:  # CTRL's repetition penalty (Keskar et al. 2019): shrink a seen token's logit
            r = p.repetition_penalty
            z = torch.where(self.seen, torch.where(z > 0, z / r, z * r), z)
        if self.counts is not None:  # OpenAI's frequency and presence penalties, on generated tokens
            z = z - p.frequency_penalty * self.counts - p.presence_penalty * (self.counts > 0).double()
        return self.took(int(sample(z[None], p.sampling, self.gen)[0]))


def logprobs(z: torch.Tensor, targets: torch.Tensor, k: int, group, vocab: int):
    """Log-probabilities of ``targets`` [N] and the ``k`` most likely tokens, from vocabulary-sharded logits.

    ``z``: [N, V_pad/t], this TP rank's columns [r * V_pad/t, (r+1) * V_pad/t) (``group`` None: the whole
    vocabulary). The normaliser log sum_v exp z_v is a max and a sum over the TP group (as the
    vocabulary-parallel loss, Shoeybi et al. 2019), and the top ``k`` are found per shard then merged: only
    [N, 3 + 2k] numbers cross ranks, never the full logits. Returns (logprob [N], top ids [N, k], top logprobs
    [N, k]), float64, identical on every rank of the group.
    """
    z = z.double()
    local = z.shape[-1]
    start = 0 if group is None else dist.get_rank(group) * local
    if start + local > vocab:  # padded columns of the last shard are not tokens
        z = z.clone()
        z[:, max(vocab - start, 0):] = float("-inf")
    z_max = z.max(-1).values
    if group is not None:
        collective("tp all-reduce of the logits' maximum (logprobs)", group,
                   lambda: dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group))
    mine = (targets >= start) & (targets < start + local)
    picked = z.gather(-1, (targets - start).clamp(0, local - 1)[:, None])[:, 0].masked_fill(~mine, 0.0)
    stats = torch.stack([(z - z_max[:, None]).exp().sum(-1), picked])  # [2, N]
    if group is not None:
        collective("tp all-reduce of the softmax sums (logprobs)", group, lambda: dist.all_reduce(stats, group=group))
    lse = z_max + stats[0].log()  # [N]
    kk = min(k, local)
    top_z, top_i = z.topk(kk, dim=-1) if kk else (z[:, :0], targets[:, None][:, :0])
    top_i = top_i + start
    if group is not None and k:
        top_z, top_i = comms.all_gather(top_z, 1, group), comms.all_gather(top_i, 1, group)  # [N, t * k]
        top_z, pick = top_z.topk(k, dim=-1)
        top_i = top_i.gather(-1, pick)
    return stats[1] - lse, top_i, top_z - lse[:, None]
