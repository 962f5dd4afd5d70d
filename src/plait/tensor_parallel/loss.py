"""Cross-entropy on vocabulary-sharded logits without gathering them (Shoeybi et al. 2019, §3)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.distributed.collectives import collective
from plait.distributed.context import ParallelContext
from plait.tensor_parallel import comms


class _VocabParallelCE(torch.autograd.Function):
    """Per-token loss log(sum_v exp z_v) - z_target over logits split by vocabulary across the TP group."""

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size, ignore_index):
        # logits: [N, V/t] (this rank's vocabulary slice), targets: [N] global ids
        z = logits if logits.dtype == torch.float64 else logits.float()  # at least float32
        local_v = z.shape[-1]
        if vocab_size is not None and vocab_start + local_v > vocab_size:  # padded columns never win
            pad_from = max(vocab_size - vocab_start, 0)
            z = z.clone()
            z[:, pad_from:] = float("-inf")
        z_max = z.max(dim=-1).values
        if group is not None:
            collective("tp all-reduce of the logits' maximum (vocabulary-parallel loss)", group,
                       lambda: dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=group))
        z = z - z_max.unsqueeze(-1)  # [N, V/t], <= 0
        ignored = targets == ignore_index
        local_t = targets - vocab_start
        outside = (local_t < 0) | (local_t >= local_v) | ignored
        picked = z.gather(-1, local_t.masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1)
        picked = picked.masked_fill(outside, 0.0)
        exp_z = z.exp()
        stats = torch.stack([exp_z.sum(dim=-1), picked])  # [2, N]: one all-reduce for both sums
        if group is not None:
            collective("tp all-reduce of the softmax sums (vocabulary-parallel loss)", group,
                       lambda: dist.all_reduce(stats, group=group))
        sum_exp, target_logit = stats[0], stats[1]
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)  # [N]
        ctx.save_for_backward(exp_z.div_(sum_exp.unsqueeze(-1)), local_t, outside, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, outside, ignored = ctx.saved_tensors
        grad = softmax.clone()  # d loss / d z = softmax - onehot(target); saved copy kept for a re-run
        # the one-hot by scatter: -1 at each row's target on this rank, 0 (no change) at column 0 of the others;
        # a boolean-mask index would size its result by the mask's values, a host wait on a GPU
        one_hot = outside.to(grad.dtype).sub_(1.0).unsqueeze(-1)  # [N, 1]: -1 where the target is here
        grad.scatter_add_(-1, local_t.masked_fill(outside, 0).unsqueeze(-1), one_hot)
        scale = grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return (grad * scale).to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, ctx: ParallelContext | None,
                                 *, ignore_index: int = -100, vocab_size: int | None = None,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits sharded along the vocabulary over ``ctx``'s TP group.

    logits_shard: [..., V_pad/t] (rank r holds global columns [r*V_pad/t, (r+1)*V_pad/t));
    targets: [...] global ids, ``ignore_index`` entries contribute nothing; ``vocab_size`` masks the
    padding columns. ``reduction``: "mean" over non-ignored tokens, "sum", or "none" (per token).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r}: expected 'mean', 'sum' or 'none'")
    tp = 1 if ctx is None else ctx.tp_size
    group = ctx.tp_group if ctx is not None and tp > 1 else None
    local_v = logits_shard.shape[-1]
    start = 0 if ctx is None else ctx.tp_rank * local_v
    flat = _VocabParallelCE.apply(logits_shard.reshape(-1, local_v), targets.reshape(-1), group, start,
                                  vocab_size, ignore_index)
    if reduction == "none":
        return flat.view(targets.shape)
    total = flat.sum()
    if reduction == "sum":
        return total
    return total / (targets != ignore_index).sum().clamp(min=1)


def full_logits(logits: torch.Tensor, ctx: ParallelContext | None, vocab_size: int) -> torch.Tensor:
    """Vocabulary-sharded logits [..., V_pad/t] -> the full [..., V]: gathered over TP, padding columns dropped."""
    if ctx is not None and ctx.tp_size > 1:
        logits = comms.all_gather(logits.contiguous(), logits.dim() - 1, ctx.tp_group)
    return logits[..., :vocab_size].contiguous()  # collectives need contiguous memory
