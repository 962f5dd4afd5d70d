"""Where a mixture-of-experts layer's experts live under tensor parallelism, as plait's runtime places them, and
what each placement holds, computes and sends per GPU (``Layout.expert_tp``).

Whole experts (``expert_tp=False``, the runtime's default; ``plait.experts.layer.ExpertParallelMoE``): within a
pipeline stage the dp·cp·tp ranks form a plane q = (dp_rank·cp + cp_rank)·tp + tp_rank and EP groups are runs
of ``ep`` consecutive q (``ParallelContext.ep_rank``, ``distributed.context._expert_groups``), so ep divides
dp·cp·tp and may span TP ranks. A GPU holds E/ep whole experts; every TP rank routes the full sequences and
dispatches only its 1/tp of the tokens (``ExpertParallelMoE._my_tokens``: its sequence shard with SP), then
all-gathers the combined rows over TP (``experts.comms.gather_rows``; nothing with SP). Expert gradients are
reduced, and under ZeRO sharded, over the expert-data-parallel group of dp·cp·tp/ep ranks
(``ParallelContext.expert_dp_size``, ``data_parallel.reducer.set_grad_group``, ``optim.shards``).

Experts split over TP (``expert_tp=True`` with tp > 1; Megatron-LM's expert tensor parallelism): EP groups are
runs of ``ep`` data-parallel ranks with the same tp_rank, so ep divides dp·cp and the group spans tp·ep ranks.
Each expert is cut like the dense MLP (``experts.layer._shard_expert``); every TP rank dispatches every token,
and the experts' partial sums are summed over TP once (all-reduce, or reduce-scatter with SP:
``ExpertParallelMoE.forward``). Expert shards are reduced over dp·cp/ep ranks.

Both placements hold the same expert elements per GPU after ZeRO's sharding and run the same expert FLOPs; they
differ in what a GPU holds unsharded, in the shapes of the expert GEMMs and in the all-to-all's bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.errors import divisors
from plait.words import counted

if TYPE_CHECKING:
    from plait.plan.config import Layout
    from plait.plan.model import Model


def split(layout: Layout) -> bool:
    """Whether each expert is split over TP (``expert_tp`` with tp > 1: ``ParallelConfig.resolve`` drops it at
    tp = 1, where both placements are the same)."""
    return layout.expert_tp and layout.tp > 1


def check(model: Model, layout: Layout) -> tuple[str, str] | None:
    """The first expert rule ``layout`` breaks, as ``config.check`` reports them: the runtime's
    (``ParallelConfig._check``, ``experts.layer.check_experts``, ``train.config._validate_model``)."""
    l, e = layout, model.n_experts
    if l.ep > 1 and e % l.ep:
        return "ep", f"ep: {l.ep} must divide n_experts = {e}; valid ep: {divisors(e)}"
    if (l.ep > 1 or l.expert_tp) and not model.is_moe:
        name = "ep" if l.ep > 1 else "expert_tp"
        return name, f"{name}: expert parallelism needs a mixture-of-experts model (n_experts > 1)"
    data = l.dp * l.cp
    if split(l) and data % l.ep:
        return "ep", (f"ep: {l.ep} must divide dp·cp = {data} with expert_tp (every TP rank holds a shard of the "
                      f"same experts, so EP spans data- and context-parallel ranks); valid ep: {divisors(data)}")
    if (data * l.tp) % l.ep:
        return "ep", f"ep: {l.ep} must divide dp·cp·tp = {data * l.tp}; valid ep: {divisors(data * l.tp)}"
    return None


def held(model: Model, layout: Layout) -> float:
    """Expert parameters of one layer on one GPU: E/ep whole experts, or their 1/tp shards."""
    if not model.is_moe:
        return 0.0
    return model.n_experts * model.mlp_params() / (layout.ep * (layout.tp if split(layout) else 1))


def dp_group(layout: Layout) -> int:
    """Ranks that hold the same expert parameters, over which their gradients are reduced and ZeRO shards them
    (``ParallelContext.expert_dp_size``)."""
    return layout.dp * layout.cp * (1 if split(layout) else layout.tp) // layout.ep


def gemms(model: Model, layout: Layout, tokens: float) -> tuple[tuple[float, float, float, float], ...]:
    """The two forward expert GEMMs of one layer on the busiest GPU, ``(m, n, k, count)`` as
    ``timing.layer_gemms``: each of its E/ep experts on the rows routed to it, ``received`` times balanced
    routing's T·top_k·ep/E of the ``tokens`` a TP rank dispatches (T/tp with whole experts, all T with split
    ones), at its full width f or its 1/tp."""
    t = layout.tp
    cut, share = (t, 1) if split(layout) else (1, t)
    rows = tokens / share * model.top_k * layout.ep / model.n_experts * received(model, layout)
    experts = model.n_experts / layout.ep
    return ((rows, model.ffn * (2 if model.glu else 1) / cut, model.hidden, experts),
            (rows, model.hidden, model.ffn / cut, experts))


def dispatch(model: Model, layout: Layout, act: float) -> tuple[float, int]:
    """(bytes the busiest GPU of an EP group receives in the dispatch all-to-all, the consecutive ranks the group
    spans) for a micro-batch whose hidden state is ``act`` bytes. With balanced routing every GPU receives what
    it sends, its tokens' rows once per routed expert (whole experts: its 1/tp of the tokens over ep consecutive
    ranks; split: all of them over ep ranks tp apart); the busiest receives ``received`` times that. The
    combine sends the same back, and every rank of the group waits for the busiest in both."""
    t = layout.tp
    if split(layout):
        return act * model.top_k * received(model, layout), t * layout.ep
    return act * model.top_k / t * received(model, layout), layout.ep


def excess_flops(model: Model, layout: Layout, tokens: float) -> float:
    """Forward FLOPs of one layer's expert GEMMs on the busiest GPU beyond balanced routing's (which
    ``timing.layer_forward_flops`` counts): ``received`` - 1 times its share, 2 FLOPs per expert weight for each of
    the ``tokens``' top_k rows over tp (whole experts on 1/tp of the rows, or split ones on 1/tp of each)."""
    return (received(model, layout) - 1) * 2 * tokens * model.top_k * model.mlp_params() / layout.tp


def tp_gathers(layout: Layout) -> tuple[int, int]:
    """The MoE layer's own collectives over TP, (forward, backward), in all-gathers of its hidden state (an
    all-reduce is two: a reduce-scatter and an all-gather). Split experts: as the dense MLP, an all-reduce each
    way (SP: a gather and a scatter each way). Whole: forward the input's copy into the TP region (nothing; SP's
    gather) and ``gather_rows`` of the combined rows (nothing with SP); backward ``gather_rows``' slice (nothing)
    and the input copy's all-reduce (SP: the gather's reduce-scatter)."""
    if split(layout):
        return 2, 2
    return 1, 1 if layout.sequence_parallel else 2


def dropless_bound(model: Model, layout: Layout) -> float:
    """The most rows a GPU's experts can receive under dropless routing, as a multiple of balanced routing's: every
    token of the EP group sends the GPU as many of its top_k rows as the GPU has experts, at most top_k (a token's
    rows go to distinct experts), so ep·min(k, E/ep)/k, where balanced routing sends each GPU k of a token's rows
    over ep (Mixtral's top-2 of 8 experts at ep 8: 4, not 8). 1 without expert parallelism."""
    if not model.is_moe or layout.ep == 1:
        return 1.0
    return layout.ep * min(model.top_k, model.n_experts / layout.ep) / model.top_k


def received(model: Model, layout: Layout) -> float:
    """The rows the busiest GPU's experts receive, as a multiple of balanced routing's: ``Model.expert_capacity``
    under expert parallelism, at most ``dropless_bound`` (the most a GPU's experts can receive); 1 without it,
    where a GPU's experts take every row its tokens route whatever the routing. plait's runtime routes dropless
    unless the model sets a capacity factor c (``LlamaConfig.capacity_factor``: an expert takes at most
    ceil(c·S·k/E) rows of a sequence), so a real step's busiest GPU keeps what this counts at 1 only when routing is
    balanced; c bounds it where an EP group dispatches whole sequences (ep a multiple of tp with whole experts).

    The planner charges it to memory (activations) and to time. An expert's capacity is c times its balanced
    share of a group's tokens (GShard, Lepikhin et al. 2020: 2S/E for a group of S tokens at top-2, tokens over
    it skipping the layer; Switch Transformer, Fedus et al. 2021, §2.2: tokens per batch / experts × capacity
    factor). The combine all-to-all waits for every rank of the EP group, so the group's step runs at its
    busiest GPU's pace: its expert GEMMs (``gemms``, ``excess_flops``: forward, backward and their
    recomputation) and the all-to-all bytes it receives (``dispatch``) scale with this. DeepSpeed's MoE layer runs
    it so: every expert takes ``capacity`` rows, padded where it is routed fewer (microsoft/DeepSpeed at 38327e07,
    ``deepspeed/moe/sharded_moe.py``: ``_capacity`` is ceil(tokens/experts × capacity factor), the factor times k
    at top-k; without token dropping the largest expert count, all-reduced with MAX over the EP group;
    ``MOELayer.forward`` sends the [experts, capacity, hidden] tensor of ``einsum("sec,sm->ecm")`` through the
    all-to-all); He et al. 2025 ("Capacity-Aware Inference: Mitigating the Straggler Effect in Mixture of Experts",
    arXiv 2503.05066) name it the straggler effect: under expert parallelism the other devices wait for the most
    loaded experts, which set the layer's latency (measured at inference)."""
    return min(model.expert_capacity, dropless_bound(model, layout))


def prediction_note(model: Model, layout: Layout) -> str | None:
    """What a prediction of one run of an MoE ``model`` under ``layout`` assumes of its routing, for the figures it
    is shown beside (``plait train``'s memory per rank), where it matters: under expert parallelism, where a
    step's routing decides which rank's experts receive the rows. None elsewhere."""
    if not model.is_moe or layout.ep == 1:
        return None
    counted_at = received(model, layout)
    bound = dropless_bound(model, layout)
    if counted_at >= bound:
        return (f"MoE: each rank's experts are predicted at {counted_at:g}× balanced routing's rows, the most "
                "they can receive")
    return (f"MoE: each rank's experts are predicted at {counted_at:g}× balanced routing's rows, the mean over "
            f"the EP group; a step's routing sends some ranks more and others less, up to {bound:g}× (every "
            f"token's top-{model.top_k} rows on one rank's {counted(model.n_experts // layout.ep, 'expert')}), so "
            "a rank's activations may measure above or below the prediction")


def routing_note(model: Model, layout: Layout) -> str:
    """One line for a plan of an MoE ``model`` whose best layout is ``layout``: how its routing is counted, and how
    far a step's uneven routing can take the busiest GPU beyond it (``dropless_bound``)."""
    note = (f"MoE routing: under expert parallelism the busiest GPU's experts are counted to receive "
            f"{model.expert_capacity:g}× balanced routing's rows (--expert-capacity), in its activation memory and "
            "in the step time (its expert GEMMs and all-to-all bytes: the EP group waits for it)")
    if layout.ep == 1:
        return note + ("; the best layout has no expert parallelism: a GPU's experts take its own tokens' rows "
                       "whatever the routing")
    bound = dropless_bound(model, layout)
    if bound <= model.expert_capacity:
        return note + f"; {bound:g}× is the most any GPU of the best layout ({layout.short()}) can receive"
    return note + (f"; plait routes dropless, so a step whose routing is more uneven keeps and takes more, up to "
                   f"{bound:g}× on the best layout ({layout.short()}: every token's top-{model.top_k} rows on one "
                   f"GPU's {counted(model.n_experts // layout.ep, 'expert')}); --expert-capacity {bound:g} plans "
                   "that bound")
