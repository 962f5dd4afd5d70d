"""Rank-side checks for tensor/sequence parallelism: collectives and layers against their definitions."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import plait
from harness import rel_err
from plait.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    comms,
    sync_tp_partial_grads,
    vocab_parallel_cross_entropy,
)

B, S, H = 2, 8, 12


def _per_rank(t: int, shape, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(t)]


def check_collectives(ctx) -> dict[str, float]:
    """Each conjugate collective's forward and backward against its mathematical definition."""
    t, r, grp = ctx.tp_size, ctx.tp_rank, ctx.tp_group
    xs = _per_rank(t, (B, S, H), 1)  # every rank's input, known to all
    gs = _per_rank(t, (B, S, H), 2)  # every rank's upstream gradient for same-shape outputs
    errs: dict[str, float] = {}

    def run(fn, x, g):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y.backward(g)
        return y.detach(), x.grad

    # f: identity / all-reduce
    y, dx = run(lambda x: comms.copy_to_tp(x, grp), xs[r], gs[r])
    errs["f_fwd"], errs["f_bwd"] = rel_err(y, xs[r]), rel_err(dx, sum(gs))
    # g: all-reduce / identity
    y, dx = run(lambda x: comms.reduce_from_tp(x, grp), xs[r], gs[r])
    errs["g_fwd"], errs["g_bwd"] = rel_err(y, sum(xs)), rel_err(dx, gs[r])
    # gather along last: [.., H] -> [.., tH]; backward takes own slice
    gfull = _per_rank(1, (B, S, H * t), 3)[0]
    y, dx = run(lambda x: comms.gather_last(x, grp), xs[r], gfull)
    errs["gather_last_fwd"] = rel_err(y, torch.cat(xs, -1))
    errs["gather_last_bwd"] = rel_err(dx, gfull.chunk(t, -1)[r])
    # scatter along last: own slice forward; backward all-gathers the ranks' slice-gradients
    gsl = [g[..., : H // t] for g in gs] if H % t == 0 else None
    if gsl is not None:
        y, dx = run(lambda x: comms.scatter_last(x, grp), xs[0], gsl[r])
        errs["scatter_last_fwd"] = rel_err(y, xs[0].chunk(t, -1)[r])
        errs["scatter_last_bwd"] = rel_err(dx, torch.cat(gsl, -1))
    # SP: gather along sequence forward / reduce-scatter backward
    gseq = _per_rank(t, (B, S * t, H), 4)
    y, dx = run(lambda x: comms.gather_seq(x, grp), xs[r], gseq[r])
    errs["gather_seq_fwd"] = rel_err(y, torch.cat(xs, 1))
    errs["gather_seq_bwd"] = rel_err(dx, sum(gseq).chunk(t, 1)[r])
    # SP: reduce-scatter along sequence forward / all-gather backward
    gsh = _per_rank(t, (B, S // t, H), 5)
    y, dx = run(lambda x: comms.reduce_scatter_seq(x, grp), xs[r], gsh[r])
    errs["reduce_scatter_seq_fwd"] = rel_err(y, sum(xs).chunk(t, 1)[r])
    errs["reduce_scatter_seq_bwd"] = rel_err(dx, torch.cat(gsh, 1))
    # SP: scatter along sequence (replicated in) / all-gather backward
    y, dx = run(lambda x: comms.scatter_seq(x, grp), xs[0], gsh[r])
    errs["scatter_seq_fwd"] = rel_err(y, xs[0].chunk(t, 1)[r])
    errs["scatter_seq_bwd"] = rel_err(dx, torch.cat(gsh, 1))
    return errs


def _dense_run(module: nn.Module, x: torch.Tensor, w_out: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = module(x)
    (y * w_out).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def check_column(ctx, sp: bool, gather_output: bool) -> dict[str, float]:
    t, r = ctx.tp_size, ctx.tp_rank
    torch.manual_seed(10)
    dense = nn.Linear(H, 4 * t, bias=True)
    x = torch.randn(B, S, H)
    w_out = torch.randn(B, S, 4 * t)
    y_ref, dx_ref, g_ref = _dense_run(copy.deepcopy(dense), x, w_out)
    layer = ColumnParallelLinear.from_dense(dense, ctx, gather_output=gather_output, sequence_parallel=sp)
    x_in = x.chunk(t, 1)[r] if sp else x
    x_in = x_in.clone().requires_grad_(True)
    y = layer(x_in)
    w_local = w_out if gather_output else w_out.chunk(t, -1)[r]
    (y * w_local).sum().backward()
    y_expect = y_ref if gather_output else y_ref.chunk(t, -1)[r]
    dx_expect = dx_ref.chunk(t, 1)[r] if sp else dx_ref
    return {"out": rel_err(y, y_expect), "dx": rel_err(x_in.grad, dx_expect),
            "dw": rel_err(layer.weight.grad, g_ref["weight"].chunk(t, 0)[r]),
            "db": rel_err(layer.bias.grad, g_ref["bias"].chunk(t, 0)[r]),
            "full_w": rel_err(layer.full_tensor("weight", layer.weight), dense.weight)}


def check_row(ctx, sp: bool) -> dict[str, float]:
    t, r = ctx.tp_size, ctx.tp_rank
    torch.manual_seed(11)
    dense = nn.Linear(4 * t, H, bias=True)
    x = torch.randn(B, S, 4 * t)
    w_out = torch.randn(B, S, H)
    y_ref, dx_ref, g_ref = _dense_run(copy.deepcopy(dense), x, w_out)
    layer = RowParallelLinear.from_dense(dense, ctx, sequence_parallel=sp)
    x_in = x.chunk(t, -1)[r].clone().requires_grad_(True)
    y = layer(x_in)
    w_local = w_out.chunk(t, 1)[r] if sp else w_out
    (y * w_local).sum().backward()
    sync_tp_partial_grads(layer.parameters(), ctx)
    return {"out": rel_err(y, y_ref.chunk(t, 1)[r] if sp else y_ref),
            "dx": rel_err(x_in.grad, dx_ref.chunk(t, -1)[r]),
            "dw": rel_err(layer.weight.grad, g_ref["weight"].chunk(t, 1)[r]),
            "db": rel_err(layer.bias.grad, g_ref["bias"])}


def check_row_scatters_input(ctx) -> dict[str, float]:
    """input_is_parallel=False: a replicated input is split across ranks inside the layer."""
    t, r = ctx.tp_size, ctx.tp_rank
    torch.manual_seed(12)
    dense = nn.Linear(4 * t, H, bias=False)
    x = torch.randn(B, S, 4 * t)
    w_out = torch.randn(B, S, H)
    y_ref, dx_ref, g_ref = _dense_run(copy.deepcopy(dense), x, w_out)
    layer = RowParallelLinear.from_dense(dense, ctx, input_is_parallel=False)
    x_in = x.clone().requires_grad_(True)
    y = layer(x_in)
    (y * w_out).sum().backward()
    return {"out": rel_err(y, y_ref), "dx": rel_err(x_in.grad, dx_ref),
            "dw": rel_err(layer.weight.grad, g_ref["weight"].chunk(t, 1)[r])}


def check_embedding(ctx, sp: bool, vocab: int = 37) -> dict[str, float]:
    t, r = ctx.tp_size, ctx.tp_rank
    torch.manual_seed(13)
    dense = nn.Embedding(vocab, H)
    ids = torch.randint(0, vocab, (B, S))
    ids[0, 0], ids[1, 1] = 0, vocab - 1  # both ends of the vocabulary
    w_out = torch.randn(B, S, H)
    ref = copy.deepcopy(dense)
    y_ref = ref(ids)
    (y_ref * w_out).sum().backward()
    layer = VocabParallelEmbedding.from_dense(dense, ctx, sequence_parallel=sp)
    y = layer(ids)
    w_local = w_out.chunk(t, 1)[r] if sp else w_out
    (y * w_local).sum().backward()
    full_grad = layer.full_tensor("weight", layer.weight.grad)
    return {"out": rel_err(y, y_ref.detach().chunk(t, 1)[r] if sp else y_ref.detach()),
            "dw": rel_err(full_grad, ref.weight.grad),
            "pad_rows": layer.weight.shape[0] * t - vocab}


def check_cross_entropy(ctx, vocab: int = 37) -> dict[str, float]:
    """Vocabulary-parallel CE equals F.cross_entropy, with ignore_index and garbage in the padding."""
    t, r = ctx.tp_size, ctx.tp_rank
    torch.manual_seed(14)
    n = 20
    logits = torch.randn(n, vocab) * 3
    targets = torch.randint(0, vocab, (n,))
    targets[::5] = -100
    ref_logits = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, targets, ignore_index=-100)
    ref.backward()
    per = -(-vocab // t)
    padded = torch.cat([logits, torch.full((n, per * t - vocab), 50.0)], dim=-1)  # padding must not win
    shard = padded.chunk(t, -1)[r].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, targets, ctx, vocab_size=vocab, ignore_index=-100)
    loss.backward()
    grad_ref = torch.cat([ref_logits.grad, torch.zeros(n, per * t - vocab)], -1).chunk(t, -1)[r]
    none = vocab_parallel_cross_entropy(shard.detach(), targets, ctx, vocab_size=vocab, reduction="none")
    return {"loss": rel_err(loss, ref), "grad": rel_err(shard.grad, grad_ref),
            "ignored_zero": float(none[targets == -100].abs().max())}


def tp_layer_checks(ctx, tag: str) -> list:
    return [
        (f"{tag}/collectives", lambda: check_collectives(ctx)),
        (f"{tag}/column", lambda: check_column(ctx, sp=False, gather_output=False)),
        (f"{tag}/column_gather", lambda: check_column(ctx, sp=False, gather_output=True)),
        (f"{tag}/column_sp", lambda: check_column(ctx, sp=True, gather_output=False)),
        (f"{tag}/row", lambda: check_row(ctx, sp=False)),
        (f"{tag}/row_sp", lambda: check_row(ctx, sp=True)),
        (f"{tag}/row_scatter", lambda: check_row_scatters_input(ctx)),
        (f"{tag}/embedding", lambda: check_embedding(ctx, sp=False)),
        (f"{tag}/embedding_sp", lambda: check_embedding(ctx, sp=True)),
        (f"{tag}/cross_entropy", lambda: check_cross_entropy(ctx)),
    ]


def layouts_for_world(world: int) -> list[tuple[int, int]]:
    """(tp, dp) pairs with tp in {1, 2, 4} that fit the world."""
    return [(tp, world // tp) for tp in (1, 2, 4) if world % tp == 0]


def rank_main() -> dict:
    torch.set_default_dtype(torch.float64)  # layer checks compare against exact definitions
    from harness import run_checks

    results: dict = {}
    world = int(__import__("os").environ["WORLD_SIZE"])
    for tp, dp in layouts_for_world(world):
        with plait.init(tp=tp, pp=1, dp=dp) as ctx:
            results.update(run_checks(tp_layer_checks(ctx, f"tp{tp}")))
    return results
