"""Model families (Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE) from Hugging Face folders: logits against
transformers, training against one device under tp2·pp2 with SP, and generation under tp2·pp2 against one device.

The parent process builds each folder with ``transformers`` from a small random config (``make_folders``) and
saves transformers' logits beside it; the ranks (inside the pipeline checks' world of 4) only use plait.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch

import plait
from harness import rel_err

VOCAB, SEQ, BATCH = 61, 8, 4
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, max_position_embeddings=32, rms_norm_eps=1e-6)
#: family -> (transformers config class, model class, config overrides); small windows and GQA shapes on purpose
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=3)),
    # Qwen's windows on some layers: the last two (max_window_layers), or those layer_types names
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, initializer_range=0.1,
                                                      use_sliding_window=True, sliding_window=3, max_window_layers=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=1, head_dim=12, use_sliding_window=True,
                                                      sliding_window=4, layer_types=["sliding_attention",
                                                      "full_attention", "sliding_attention", "full_attention"])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            sliding_window=5)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, head_dim=12,
                                                                moe_intermediate_size=24, norm_topk_prob=True,
                                                                use_sliding_window=True, sliding_window=5)),
}


def tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return t[:, :-1].clone(), t[:, 1:].clone()


def hf_model(family: str, seed: int = 0, **overrides):
    """A random transformers model of ``family`` (``overrides``: config fields); biases and norms perturbed so that
    they matter."""
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**{**COMMON, **extra, **overrides})
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
    return model


def make_folders(root: Path) -> Path:
    """Parent side: one Hugging Face folder per family, with transformers' logits of ``tokens()`` in ref.pt."""
    for family in FAMILIES:
        model = hf_model(family)
        model.save_pretrained(root / family)
        with torch.no_grad():
            torch.save(model(tokens()[0]).logits, root / family / "ref.pt")
    return root


def _parallel(folder: Path, ctx, **kw):
    """The family's model built on the meta device, sharded, and filled slice by slice from the folder."""
    from plait.checkpoint.shards import load_local
    from plait.models.hf import HFWeights, load_pretrained

    weights = HFWeights(folder)
    with torch.device("meta"):
        model = weights.family.model_class(weights.config)
    pm = plait.parallelize(model, ctx, **kw)
    load_local(pm, weights.read)
    return pm, load_pretrained(folder)


def compare_family(folder: Path, ctx, schedule: str, export: Path | None = None) -> dict:
    """tp2·pp2 + SP: logits vs transformers; loss and gradients vs the plain model on one device. ``export``:
    rank 0 writes the full tensors gathered from the shards as a Hugging Face folder (the parent loads it)."""
    import torch.distributed as dist

    from plait.models.hf import save_state_dict_pretrained

    x, y = tokens()
    pm, plain = _parallel(folder, ctx, schedule=schedule, microbatches=4, sequence_parallel=True)
    hf_logits = torch.load(folder / "ref.pt")
    logits = pm.eval_step(x)
    full = pm.full_state_dict()  # collective
    if export is not None and dist.get_rank() == 0:
        save_state_dict_pretrained(pm.family, pm.model_config, full, export)
    loss = pm.train_step(x, y)
    ref = plain.loss(x, y)
    ref.backward()
    ref_loss = ref.item()
    grads = pm.full_state_dict(grads=True)
    errs = {k: rel_err(grads[k], p.grad) for k, p in plain.named_parameters()}
    return {"family": pm.family.name, "logits_max_abs": float((logits - hf_logits).abs().max()),
            "plain_max_abs": float((plain(x).detach() - hf_logits).abs().max()),
            "loss_rel": abs(loss - ref_loss) / ref_loss, "grad_rel_max": max(errs.values()),
            "worst": max(errs, key=errs.get), "n_grads": len(errs)}


def _serve(pm, plain) -> dict:
    """plait serve's paged KV cache under tp2·pp2 (the serving Runner on every rank, fed as the engine feeds it:
    prompts in chunks of 3 beside other rows, then one token a row, blocks of 2) against the plain model's
    generate on one device. Prompts and outputs run past the windows (3 and 5), across block boundaries."""
    import torch.distributed as dist

    from plait.generation import Sampling
    from plait.serve.runner import Row, Runner, Step
    from plait.serve.sampling import Params

    prompts = [[5, 17, 3, 40, 22, 9, 31, 8], [9, 2, 44, 7], [1, 60, 33, 12, 25, 6, 50]]
    n, block = 7, 2
    runner = Runner(pm, num_blocks=8 * len(prompts), block_size=block)
    tables = [list(range(8 * r, 8 * r + 8)) for r in range(len(prompts))]  # 16 positions each
    known, done = [list(p) for p in prompts], [0] * len(prompts)
    step = Step(new=[(r, Params(Sampling(n))) for r in range(len(prompts))])
    while any(len(k) - len(p) < n for k, p in zip(known, prompts, strict=True)):
        step.rows = []
        for r, k in enumerate(known):
            if len(k) - len(prompts[r]) < n:
                feed = k[done[r]: min(done[r] + 3, len(k))]
                step.rows.append(Row(r, feed, done[r], tables[r], done[r] + len(feed) == len(k)))
        box = [runner.execute(step)]
        dist.broadcast_object_list(box, src=0)  # rank 0 has the outputs: every rank makes the same next step
        for row, out in zip(step.rows, box[0], strict=True):
            done[row.rid] += len(row.tokens)
            if row.sample:
                known[row.rid].append(out[0])
        step = Step()
    return {"parallel": [k[len(p):] for k, p in zip(known, prompts, strict=True)],
            "single": [plait.generate(plain, p, max_new_tokens=n) for p in prompts]}


def generate_family(folder: Path, ctx) -> dict:
    """plait.generate under tp2·pp2 (the `plait generate` loading path) against the plain model on one device;
    ``serve``: the same for plait serve's paged KV cache (``_serve``)."""
    from plait.generation.job import load_model

    pm = load_model(str(folder), ctx=ctx)[0]
    plain = load_model(str(folder))[0]
    prompts = [[5, 17, 3, 40], [9, 2]]
    out = {}
    for name, model in (("parallel", pm), ("single", plain)):
        out[name] = [plait.generate(model, prompts, max_new_tokens=7),
                     plait.generate(model, prompts, max_new_tokens=7, temperature=0.9, top_k=8, seed=3)]
    out["serve"] = _serve(pm, plain)
    return out


def family_checks(root: Path, contexts: ExitStack) -> list:
    """The families' checks, over contexts that ``contexts`` closes once they have run."""
    tp2pp2 = contexts.enter_context(plait.init(tp=2, pp=2, dp=1))
    checks = []
    for family, schedule in (("mistral", "1f1b"), ("qwen2", "zbv"), ("qwen3", "interleaved-1f1b"),
                             ("mixtral", "1f1b"), ("qwen3_moe", "zb-h1")):
        checks.append((f"family/{family}", lambda f=family, s=schedule: compare_family(root / f, tp2pp2, s,
                                                                                       root / f"{f}-export")))
        checks.append((f"family/{family}/generate", lambda f=family: generate_family(root / f, tp2pp2)))
    ep2 = contexts.enter_context(plait.init(tp=2, pp=2, dp=1, ep=2))
    checks.append(("family/mixtral/ep2", lambda: compare_family(root / "mixtral", ep2, "zbv")))
    checks.append(("family/qwen3_moe/ep2", lambda: compare_family(root / "qwen3_moe", ep2, "1f1b")))
    etp = contexts.enter_context(plait.init(tp=2, pp=2, dp=1, expert_tp=True))
    checks.append(("family/mixtral/expert_tp", lambda: compare_family(root / "mixtral", etp, "1f1b")))
    return checks
