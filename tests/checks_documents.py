"""Document masking of packed samples (plait.documents): the reference (each document run alone through the plain
model) and the rank side of tests/test_documents.py's layouts (4 ranks), each against that reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import plait
from checks_context import BATCH, SEQ, against, model_config
from harness import rel_err, run_checks
from plait.models import Llama, LlamaConfig

EOS = 0
#: where each row's end-of-document tokens sit: rows 0 and 1 hold several documents (one ends at the row's last
#: token, one is a lone EOS at the start), rows 2 and 3 one each (a micro-batch of them runs unmasked attention)
EOS_AT = {0: (3, 9), 1: (0, 6, 15), 2: (), 3: ()}


def packed(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets [BATCH, SEQ]: random tokens (no EOS) with EOS at ``EOS_AT``; one target ignored."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(1, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    for row, at in EOS_AT.items():
        tokens[row, list(at)] = EOS
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    targets[2, 4] = -100  # an ignored target stays ignored
    return inputs, targets


def documents(row: torch.Tensor, eos: int = EOS) -> list[slice]:
    """The documents of one row of inputs: each ends with an EOS (included) or at the row's end."""
    cuts = [i + 1 for i, t in enumerate(row.tolist()) if t == eos and i + 1 < len(row)]
    return [slice(a, b) for a, b in zip([0, *cuts], [*cuts, len(row)], strict=True)]


def alone(cfg: LlamaConfig, inputs: torch.Tensor, targets: torch.Tensor, eos: int = EOS,
          model: Llama | None = None):
    """Loss, gradients and logits of every document run alone through the plain model (``model``, or one seeded as
    ``plait.parallelize(Llama(cfg))`` after ``torch.manual_seed(0)``): the loss is the mean cross-entropy over all
    the documents' targets but those after an EOS, the logits those of each document alone."""
    if model is None:
        torch.manual_seed(0)
        model = Llama(cfg)
    total, count = torch.zeros(()), 0
    logits = torch.zeros(*inputs.shape, cfg.vocab_size)
    for r in range(inputs.shape[0]):
        for doc in documents(inputs[r], eos):
            x, y = inputs[r:r + 1, doc], targets[r:r + 1, doc].clone()
            y[x == eos] = -100  # the next document's first token is not predicted from this one
            out = model(x)
            logits[r, doc] = out[0].detach()
            total = total + F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
            count += int((y != -100).sum())
    loss = total / count
    loss.backward()
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}, logits


def compare(model_kw: dict | None = None, document_eos: int | None = EOS, **layout) -> dict:
    """One train_step and one eval_step with document masking under ``layout`` against each document alone."""
    cfg = model_config(**(model_kw or {}))
    inputs, targets = packed(cfg)
    return against(alone(cfg, inputs, targets), cfg, inputs, targets, layout, document_eos=document_eos)


# no load-balancing loss: it is the packed row's (routing knows no documents), which documents alone do not have
MOE = dict(n_experts=4, top_k=2, moe_every=2, aux_loss_coef=0.0)
FEATURES = dict(sliding_window=5, qkv_bias=True, qk_norm=True)  # the window is ANDed with the document mask
#: name -> (ParallelConfig fields, model config fields), all on 4 ranks
CASES: dict[str, tuple[dict, dict]] = {
    "tp2sp/pp2/1f1b": (dict(tp=2, pp=2, dp=1, sequence_parallel=True, microbatches=4), {}),
    "pp4/1f1b/full": (dict(pp=4, dp=1, microbatches=4, recompute="full"), {}),
    "pp2/zbv/dp2/selective": (dict(pp=2, dp=2, schedule="zbv", microbatches=2, recompute="selective"), {}),
    "tp2dp2ep2/full": (dict(tp=2, dp=2, ep=2, recompute="full"), MOE),
    "dp4/zero3/features": (dict(dp=4, zero=3), FEATURES),
    "cp4/allgather": (dict(cp=4, dp=1, microbatches=2, cp_comm="allgather"), {}),
    "cp4/ring/features": (dict(cp=4, dp=1, microbatches=2, cp_comm="ring"), FEATURES),
    "cp2tp2sp/ring": (dict(cp=2, tp=2, dp=1, sequence_parallel=True, cp_comm="ring"), {}),
    "cp2pp2/1f1b/full/ring": (dict(cp=2, pp=2, dp=1, microbatches=4, recompute="full", cp_comm="ring"), {}),
    "cp2dp2/selective/allgather": (dict(cp=2, dp=2, recompute="selective"), {}),
}


#: Adam's epsilon in the ZeRO checks: at torch's 1e-8 a gradient element near 1e-8, summed in another order by the
#: reference (document by document) than by the packed rows, moves by a visible share of the learning rate
EPS = 1e-5


def zero_steps(level: int, steps: int = 3, **layout) -> dict:
    """``steps`` clipped AdamW steps on the packed batch with a ZeRO-``level`` ParallelOptimizer under ``layout``
    against torch's AdamW on the plain model's loss of each document alone."""
    from plait.optim import ParallelOptimizer

    cfg = model_config()
    inputs, targets = packed(cfg)
    torch.manual_seed(0)
    ref = Llama(cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, eps=EPS)
    for _ in range(steps):
        opt.zero_grad()
        alone(cfg, inputs, targets, model=ref)  # its backward leaves the gradients
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    with plait.init(config=plait.ParallelConfig(**layout)) as ctx:
        torch.manual_seed(0)
        pm = plait.parallelize(Llama(cfg), ctx, document_eos=EOS)
        popt = ParallelOptimizer(pm, torch.optim.AdamW, lr=1e-2, weight_decay=0.0, eps=EPS, zero=level, clip=1.0)
        per = BATCH // ctx.dp_size
        local = slice(ctx.dp_rank * per, (ctx.dp_rank + 1) * per)
        for _ in range(steps):
            pm.zero_grad()
            pm.train_step(inputs[local], targets[local])
            popt.step()
        state = pm.full_state_dict()
    return {"param_rel_max": max(rel_err(state[k], v) for k, v in ref.state_dict().items())}


def rank_main() -> dict:
    checks = [(f"equal/{name}", lambda lay=lay, mk=mk: compare(mk, **lay)) for name, (lay, mk) in CASES.items()]
    checks += [(f"bf16/{comm}", lambda c=comm: compare(None, cp=2, dp=2, precision="bf16", cp_comm=c))
               for comm in ("allgather", "ring")]
    checks += [("unmasked/cp2dp2", lambda: compare(None, None, cp=2, dp=2))]
    checks += [("zero1/cp2dp2/ring", lambda: zero_steps(1, cp=2, dp=2, cp_comm="ring")),
               ("zero2/tp2dp2", lambda: zero_steps(2, tp=2, dp=2))]
    return run_checks(checks)
