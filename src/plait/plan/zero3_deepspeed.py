"""ZeRO-3 as DeepSpeed v0.3.13 runs it (``Training.zero3_impl``: ``IMPLS``), for runs of another stack.

What its code does, each step (microsoft/DeepSpeed at tag v0.3.13, ``deepspeed/runtime/zero/``; the defaults of
``constants.py`` where a run's configuration is not printed):

- Parameters of fewer than ``stage3_param_persistence_threshold`` (1e5) elements stay whole on every rank
  (``stage3.py`` ``persistent_parameters``: ``ds_persist``): biases and norms are never gathered.
- Each other parameter is all-gathered on its own (``partition_parameters.py`` ``_allgather_param``: one
  all-gather per parameter, after a device-wide synchronize; ``Gather`` below says what one costs) when a
  sub-module's forward or backward hook needs it
  (``stage3.py`` ``fetch_sub_module``), which then waits for it and for the device (``_synchronize_communication``):
  every fetch that gathers or waits on a gather ends all work in flight, compute and collectives alike.
- After each fetch ``prefetch_next_sub_modules`` gathers the next parameters of the recorded trace that are
  not gathered yet, up to ``stage3_prefetch_bucket_size`` (5e7) elements, but only when no prefetch is in flight
  and fewer than ``stage3_max_live_parameters`` (1e9) elements are gathered; each of those gathers starts with a
  device-wide synchronize too, so only the last one runs beside the sub-module's compute, until the next fetch.
- After its use a sub-module's parameters are released unless the trace uses it again within
  ``stage3_max_reuse_distance`` (1e9) elements of other sub-modules' parameters (``release_sub_module``,
  ``_keep_for_later``). With full recomputation the recomputed forward fires the hooks again: a layer's weights
  are gathered for the forward, for the recomputation and, unless kept, again for the backward.
- Gradients: with ``contiguous_gradients`` off (stage 3's default; ``zero3_impl="deepspeed-0.3"``) each backward's
  fp16 gradients fill buckets of ``reduce_bucket_size`` (5e8) elements, a bucket flushed when the next gradient
  would overflow it, each flushed bucket all-reduced (``reduce_independent_p_g_buckets_and_remove_grads``,
  ``reduce_ipg_grads``, ``buffered_reduce_fallback``) on the reduction stream (``overlap_comm``, stage 3's default:
  beside the compute, until the next device-wide synchronize); the last bucket after the backward, waited for
  (``independent_gradient_partition_epilogue``). With it on (``zero3_impl="deepspeed-0.3-contiguous"``, as every
  ZeRO-3 configuration DeepSpeed published then sets it: ``docs/_tutorials/zero.md`` at v0.3.13, and
  microsoft/DeepSpeedExamples ``Megatron-LM-v1.1.5-ZeRO3/examples/ds_zero_stage_3_config.json`` at 2cd968f2 and
  ``ds_zero_stage_3_config_release.json`` at bdf8e59a) the bucket is reduced as the next gradient would overflow it
  too, but ``reduce_ipg_grads`` first waits on the host for the reduction stream (``overlap_comm``:
  ``reduction_stream.synchronize()``), then divides the bucket by W and reduce-scatters it parameter by parameter
  (``average_tensor``, ``reduce_gradients_at_owner``; ``partition_parameters.py`` ``_reduce_scatter_gradient``,
  lines 733-771: a Python loop of W ``narrow`` views of the gradient, then ``torch.distributed.reduce_scatter`` of
  that list, whose ``ProcessGroupNCCL::reduce_scatter`` issues from the host one ``copy_`` (with its
  ``recordStream``) of each of the W inputs into a flat buffer on NCCL's stream before ``ncclReduceScatter``, in
  the form of ``torch/lib/c10d/ProcessGroupNCCL.cpp`` the gather below was read in; v1.8.0's own not read). A
  gradient larger than the bucket (3e6, 5e7 and 9e7 in those configurations: every layer's weight matrix here) is
  reduced at the next gradient's arrival, so each weight is reduce-scattered in a call of its own, with the biases
  and norms that came before it; ``walk`` reduces each sub-module's gradients at its own hook (the code: a hook
  later). After each backward every parameter is released (``_partition_all_parameters``): each micro-batch starts
  again.
- A tied word embedding, which the logits use outside its module, is registered as the top module's external
  parameter (``docs/_tutorials/zero.md`` at v0.3.13, Megatron-LM's ``GPT2Model``): gathered at the top module's
  first hook and held through the forward and the backward (it counts against the live parameters throughout).
- The persistent parameters are partitioned too after each backward (``backward`` calls
  ``_partition_all_parameters``, whose ``release_and_reset_parameter`` partitions every parameter still whole), and
  gathered again once a step, after the optimizer step (``_post_step``: ``all_gather`` of the whole list, whose
  ``async_op=False`` path is ``_allgather_params``, ``partition_parameters.py``; the same code at v0.3.13 to v0.3.16):
  one all-gather of their partitions concatenated, through torch's list API (W views of a flat buffer, the
  collective and its W copies as ``Gather`` below), then, for each persistent parameter, a Python loop over the W
  ranks making two views and one ``copy_`` of that rank's slice into the whole tensor (for each rank whose slice
  holds any of it): ``persistent_gather``. Once a step, not hidden: nothing else is in flight then.

``exposed`` walks that trace: the collectives share the network (one process group), the compute runs beside
whatever collective was launched with it, and each synchronize waits for the longer of the two.

One parameter's gather over its group of W ranks, as ``_allgather_param`` (lines 596-636) runs it: ``torch.zeros``
of the padded full parameter (written through HBM), the device-wide synchronize, then a Python loop making the W
``narrow`` views of that buffer (calling ``get_rank(group)`` each turn) before ``torch.distributed.all_gather`` of
that list is called. torch's ``ProcessGroupNCCL::allgather`` of a list (``torch/lib/c10d/ProcessGroupNCCL.cpp``: the
same code in each version of it read, pytorch/pytorch 6f583bb5 with 2019's API through 00f5dfd5 with 2021's;
v1.8.0's own not read) allocates a flat output (``flatten_for_scatter_gather``), launches ``ncclAllGather`` into
it, then, on the host, makes one ``recordStream`` and one ``copy_`` of each of the W slices back into the list, each
copy queued behind the gather on NCCL's stream: the host issues the W copies while the gather runs, the device
runs each once the gather is done and the copy issued. DeepSpeed replaced the list by ``_all_gather_base`` in PR
#1188 (commit c0eeb69d, first in v0.5.5: "the ``torch.distributed.all_gather`` will do implicit memcpy at the end
of each ``ncclAllgather``").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from plait.plan.cluster import Cluster
from plait.plan.config import GRAD_DTYPES, Layout, Training
from plait.plan.costs import CostModel, StageCosts
from plait.plan.model import Model
from plait.plan.timing import layer_gemms

#: stage3_param_persistence_threshold, stage3_prefetch_bucket_size, stage3_max_live_parameters,
#: stage3_max_reuse_distance and reduce_bucket_size: their defaults (deepspeed/runtime/zero/constants.py at v0.3.13)
PERSISTENCE_THRESHOLD = 100_000
PREFETCH_BUCKET = 50_000_000
MAX_LIVE = 1_000_000_000
MAX_REUSE = 1_000_000_000
REDUCE_BUCKET = 500_000_000

#: ``Training.zero3_impl`` values costed here: v0.3.13 with its defaults, and with ``contiguous_gradients`` on
IMPLS = ("deepspeed-0.3", "deepspeed-0.3-contiguous")
CONTIGUOUS = IMPLS[1]

#: host seconds of one slice's ``copy_`` (with its ``recordStream``) in torch 1.8's list all-gather: a tiny kernel's
#: host cost as this project measured it on an H200 (torch 2.11, ``bench/gpu_check.py`` ``launch_us``: 10.1 µs in the
#: newest run, 6.8-10.4 µs over runs; docs/runtime.md), taken for an eager operation's dispatch and launch of that era
#: too (no figure of torch 1.8's on an A100 host was found); not fitted to any run
COPY_HOST_S = 10.1e-6
#: host seconds of one turn of ``_allgather_param``'s view loop (a ``narrow`` and a ``get_rank(group)`` in Python):
#: 2.0 µs measured on this project's 2-core CPU host (torch 2.13, loops of 1,536 turns, load 0.1; docs/planner.md);
#: not fitted
VIEW_HOST_S = 2.0e-6

#: host seconds of one turn of ``_allgather_params``' copy-back loop without its ``copy_`` (the loop's arithmetic,
#: ``partitions[i].narrow``, ``replicated_tensor.view(-1).narrow``): 1.9 times the view loop's turn (``VIEW_HOST_S``)
#: in the same process on this project's 2-core CPU host (torch 2.13, CPU tensors, the two loops as the code has them
#: over 1,536 ranks, interleaved in chunks of 64 turns, their fastest chunks; docs/planner-log.md entry 33); the
#: copy's own issue is ``COPY_HOST_S``; not fitted
COPY_BACK_HOST_S = 3.8e-6

# what share of a pass a use's compute is: (pass, share) with pass one of "f", "r", "b" (a layer's forward,
# recomputation, backward), "ef", "eb" (the embedding's), "hf", "hb" (the head's), or "" (none)
Share = tuple[str, float]


@dataclass(frozen=True)
class Use:
    """One sub-module's turn in the trace: its id, the elements a fetch gathers (its parameters above the
    persistence threshold), all its elements (the reuse distance counts them), its compute and the gradient
    elements its backward hands to the reduction buckets. ``held``: the top module's, whose hooks enclose the
    whole forward and backward (each releasing hook at a pass's end, the next use right after): kept throughout."""

    module: str
    gathered: int
    numel: int
    compute: Share
    grads: int = 0
    held: bool = False
    #: each parameter tensor whose gradient the backward hands over at this use (the sub-module's weight and bias,
    #: and a norm's beside it): what ``contiguous_gradients`` reduce-scatters one call each
    grad_tensors: tuple[int, ...] = ()


def _layer_modules(model: Model, layout: Layout) -> list[tuple[str, int, int]]:
    """A layer's sub-modules with parameters, in forward order, on one rank: (name, weight, bias) elements, one per
    forward GEMM of ``timing.layer_gemms`` (an [m, k] by [k, n] product, ``count`` of them, holds k·n·count weight
    and n·count bias elements): the fused QKV projection, the attention's output projection, the MLP's first (gate
    and up fused with a GLU) and second linear layers (Megatron-LM's ``ParallelSelfAttention`` and
    ``ParallelMLP``); an MoE layer's E/ep experts lumped into the two MLP uses."""
    b = 1 if model.bias else 0
    return [(name, round(k * n * count), b * round(n * count))
            for name, (_, n, k, count) in zip(("qkv", "proj", "fc1", "fc2"), layer_gemms(model, layout), strict=True)]


def _gathered(*sizes: int) -> int:
    return sum(s for s in sizes if s >= PERSISTENCE_THRESHOLD)


@lru_cache(maxsize=64)
def trace(model: Model, layout: Layout) -> tuple[Use, ...]:
    """One micro-batch's sub-module uses in order. A tied word embedding is the top module's external parameter
    (gathered at its first hook, used again by the logits); the forward, then the backward with, under full
    recomputation, each layer's forward again before its backward."""
    mods = _layer_modules(model, layout)
    total = sum(w + b for _, w, b in mods)
    tied = model.tied_embeddings
    word = model.vocab * model.hidden // layout.tp
    pos = model.seq_len * model.hidden if model.learned_positions else 0
    own = 0 if tied else word  # the embedding's and the head's own weights when untied
    top = Use("top", _gathered(word) if tied else 0, word if tied else 0, ("", 0.0), held=True)

    norm = (model.hidden,) * (2 if model.layernorm else 1)  # a norm's weight (and bias)
    beside = {"qkv": norm, "fc1": norm}  # the input norms' gradients follow the layer's first GEMM of each block

    def layer(i: int, kind: str, grads: bool, order: list[tuple[str, int, int]]) -> list[Use]:
        return [Use(f"{name}{i}", _gathered(w, b), w + b, (kind, (w + b) / total), w + b if grads else 0,
                    grad_tensors=tuple(x for x in (w, b, *beside.get(name, ())) if x) if grads else ())
                for name, w, b in order]

    uses = [top, Use("embedding", _gathered(own, pos), own + pos, ("ef", 1.0))]
    for i in range(model.n_layers):
        uses += layer(i, "f", False, mods)
    uses += [Use("head", _gathered(own), own, ("hf", 1.0)), top,
             Use("head", _gathered(own), own, ("hb", 1.0), own, grad_tensors=tuple(x for x in (own, *norm) if x))]
    for i in reversed(range(model.n_layers)):
        if layout.recompute == "full":
            uses += layer(i, "r", False, mods)
        uses += layer(i, "b", True, mods[::-1])
    return (*uses, Use("embedding", _gathered(own, pos), own + pos, ("eb", 1.0), word + pos,
                       grad_tensors=tuple(x for x in (word, pos) if x)))


@lru_cache(maxsize=64)
def _kept(uses: tuple[Use, ...]) -> tuple[bool, ...]:
    """Whether each use's parameters stay gathered after it: held, or the trace uses its module again within
    ``MAX_REUSE`` elements of the uses in between."""
    before = [0]
    for u in uses:
        before.append(before[-1] + u.numel)
    last: dict[str, int] = {}
    kept = [False] * len(uses)
    for i in reversed(range(len(uses))):
        j = last.get(uses[i].module)
        kept[i] = uses[i].held or (j is not None and before[j] - before[i + 1] < MAX_REUSE)
        last[uses[i].module] = i
    return tuple(kept)


@dataclass(frozen=True)
class Gather:
    """One parameter's all-gather as ``_allgather_param`` runs it, in seconds: ``zeros``, the device writing the
    zeroed buffer before the synchronize (beside the compute and the collectives in flight); ``views``, the host's
    view loop after the synchronize, before the collective starts; ``issue``, the host issuing the W copies after
    the gather's launch (what the host launches next waits for it); ``done``, from the launch until the gather and
    its copies are finished on the device."""

    done: float
    views: float = 0.0
    issue: float = 0.0
    zeros: float = 0.0


@dataclass(frozen=True)
class Walk:
    """One micro-batch under DeepSpeed v0.3.13's ZeRO-3: its seconds (compute and what of the collectives the
    compute does not hide), and the all-gathers and gradient all-reduces it issues."""

    seconds: float
    gathers: int
    reductions: int


@dataclass(frozen=True)
class Scatter:
    """One parameter's gradient reduce-scattered as ``_reduce_scatter_gradient`` runs it, in seconds: ``issue``, the
    host making the W views and issuing the W copies into the flat input (the collective starts after them);
    ``done``, the device from then on (the bucket's division by W, the last copy, the collective)."""

    done: float
    issue: float = 0.0


def walk(uses: tuple[Use, ...], compute: dict[str, float], gather: Callable[[int], Gather],
         reduce_s: Callable[[int], float], scatter: Callable[[int], Scatter] | None = None) -> Walk:
    """Walk ``uses`` with ``compute[pass]`` seconds per pass, ``gather(elements)`` one parameter's all-gather and
    ``reduce_s(elements)`` the seconds of one all-reduce of a bucket; with ``scatter`` (``contiguous_gradients``)
    each gradient tensor reduce-scattered on its own as ``scatter(elements)`` says instead, after the host has
    waited for the reductions before it (not for a prefetched gather: another stream); the compute a sub-module
    launches waits for the host's work before it."""
    kept = _kept(uses)
    # since the last synchronize: the compute's, the network's, the host's and the reduction stream's seconds (a
    # fetch's device-wide synchronize empties every stream)
    clock = busy = net = host = reduced = 0.0
    available: set[str] = set()
    flight: set[str] = set()
    live = bucket = gathers = reductions = 0

    def sync() -> None:
        nonlocal clock, busy, net, host, reduced
        clock += max(busy, net, host)
        busy = net = host = reduced = 0.0

    for i, u in enumerate(uses):
        if u.module in flight or (u.gathered and u.module not in available):
            g = None if u.module in flight else gather(u.gathered)
            net = max(net, g.zeros if g else 0.0)
            sync()
            available |= flight
            flight.clear()
            if g is not None:
                clock += g.views + g.done  # waited for at once
                gathers += 1
                available.add(u.module)
                live += u.gathered
        if not flight and live < MAX_LIVE:
            ahead = 0
            for j in range(i + 1, len(uses)):
                v = uses[j]
                if v.gathered and v.module not in available and v.module not in flight:
                    g = gather(v.gathered)
                    net = max(net, g.zeros)
                    sync()
                    clock += g.views
                    net, busy = g.done, g.issue  # the compute launched after it waits for the copies' issue
                    gathers += 1
                    flight.add(v.module)
                    live += v.gathered
                    ahead += v.gathered
                    if ahead >= PREFETCH_BUCKET:
                        break
        kind, share = u.compute
        busy = max(busy, host) + compute.get(kind, 0.0) * share
        if scatter is not None:
            if u.grad_tensors:
                host = max(host, reduced)  # reduce_ipg_grads: reduction_stream.synchronize() first
            for elements in u.grad_tensors:
                one = scatter(elements)
                host += one.issue
                net = reduced = max(net, host) + one.done
                reductions += 1
        elif u.grads:
            if bucket and bucket + u.grads > REDUCE_BUCKET:
                net += reduce_s(bucket)
                reductions += 1
                bucket = 0
            bucket += u.grads
        if u.module in available and not kept[i]:
            available.discard(u.module)
            live -= u.gathered
    if bucket:
        net += reduce_s(bucket)
        reductions += 1
    sync()
    return Walk(clock, gathers, reductions)


def gather_cost(costs: CostModel, elements: int, n: int, span: int) -> Gather:
    """One parameter's gather of ``elements`` fp16 elements over ``n`` ranks spread over ``span``: the zeros and the
    copies (each element read and written once) at the cost model's memory bandwidth, W = ``n`` copies issued and
    ``n`` views made at ``COPY_HOST_S`` and ``VIEW_HOST_S``. The copies run behind the gather, or, when their issue is
    the slower, each as the host issues it (the last one's bytes after the issue); a copy's device cost beyond its
    bytes is not counted."""
    nbytes = costs.weight_gather_bytes * elements
    copies, issue = costs.stream_time(2 * nbytes, 0), n * COPY_HOST_S
    net = costs.collective("all_gather", nbytes, n, span)
    return Gather(max(net + copies, issue + copies / n), n * VIEW_HOST_S, issue, costs.stream_time(nbytes, 0))


def scatter_cost(costs: CostModel, elements: int, n: int, span: int, grad: float) -> Scatter:
    """One gradient of ``elements`` (``grad`` bytes each) reduce-scattered over ``n`` ranks spread over ``span``:
    W = ``n`` views and copies issued at ``VIEW_HOST_S`` (the gather's loop turn: a ``narrow`` and, there, a
    ``get_rank``) and ``COPY_HOST_S``; then the bucket's ``div_`` (read and written once), the last copy's bytes (its
    1/W of the gradient read and written; the others run as issued) and the collective. Nothing fitted."""
    nbytes = grad * elements
    device = costs.stream_time(2 * nbytes, 0) * (1 + 1 / n) + costs.collective("reduce_scatter", nbytes, n, span)
    return Scatter(device, n * (VIEW_HOST_S + COPY_HOST_S))


def persistent(model: Model, layout: Layout) -> tuple[int, ...]:
    """Elements of each parameter tensor on a rank with fewer than ``PERSISTENCE_THRESHOLD`` (``persistent_parameters``:
    ``ds_persist``), in the order ``trace`` has them: each layer's biases and its two norms' tensors, the final norm's,
    and an embedding or head that small."""
    norm = (model.hidden,) * (2 if model.layernorm else 1)
    layer = [x for _, w, b in _layer_modules(model, layout) for x in (w, b) if x] + [*norm, *norm]
    word = model.vocab * model.hidden // layout.tp
    pos = model.seq_len * model.hidden if model.learned_positions else 0
    tensors = [*layer * model.n_layers, *norm, word, pos, 0 if model.tied_embeddings else word]
    return tuple(x for x in tensors if 0 < x < PERSISTENCE_THRESHOLD)


def persistent_gather(costs: CostModel, model: Model, layout: Layout) -> float:
    """Seconds of ``_post_step``'s gather of the persistent parameters over W = dp·cp ranks, once a step:
    ``_allgather_params`` copies the rank's own partition of each into the flat buffer (a ``copy_`` each), gathers
    the concatenated partitions (each padded to a multiple of W, ``_aligned_size``) as ``gather_cost`` says, then
    copies each parameter back rank by rank: for every rank whose slice starts inside the parameter, a turn of the
    loop (``COPY_BACK_HOST_S``) and a ``copy_`` issued (``COPY_HOST_S``), the device running each tiny copy as it is
    issued. Its buffer is ``torch.empty`` (no zeros' bytes)."""
    sizes = persistent(model, layout)
    if not sizes:
        return 0.0
    n = layout.dp * layout.cp
    parts = [-(-s // n) for s in sizes]
    one = gather_cost(costs, sum(parts) * n, n, layout.tp * n)
    turns = sum(min(n, -(-s // p)) for s, p in zip(sizes, parts, strict=True))
    return len(sizes) * COPY_HOST_S + one.views + one.done + turns * (COPY_BACK_HOST_S + COPY_HOST_S)


def exposed(model: Model, cluster: Cluster, layout: Layout, training: Training, rank: StageCosts) -> float:
    """Seconds a micro-batch's ZeRO-3 traffic adds to ``rank``'s compute (its forward, recomputation and
    backward, split over the sub-modules by their elements; the embedding's and the head's from the cost
    model's blocks): ``walk`` over dp·cp ranks, fp16 weights gathered as ``Gather`` says (the copies' and the
    zeros' bytes at the cost model's memory bandwidth), gradients all-reduced in ``training.grad_dtype``."""
    costs = cluster.costs
    n = layout.dp * layout.cp
    span = layout.tp * n
    blocks = costs.blocks(model, layout, training.precision, training.tp_comm_overlap, training.tp_overlap_sms,
                          sp_async=training.sp_async_backward, early_stop=training.recompute_early_stop)
    emb, head = blocks.embedding, blocks.head
    layers = max(1, rank.layers)
    head_r = head.recompute if training.recompute_head else 0.0
    compute = {"ef": emb.forward, "eb": emb.b_compute + emb.b_tp + emb.recompute,
               "hf": head.forward, "hb": head.b_compute + head.b_tp + head_r,
               "f": (rank.forward - emb.forward - head.forward) / layers,
               "r": (rank.recompute - emb.recompute - head_r) / layers,
               "b": (rank.b_compute + rank.b_tp - emb.b_compute - emb.b_tp - head.b_compute - head.b_tp) / layers}
    if layout.recompute != "full":  # recomputation, if any, runs inside each layer's backward
        compute["b"] += compute.pop("r")
    grad = GRAD_DTYPES[training.grad_dtype]

    def reduce_s(elements: int) -> float:
        return costs.collective("all_reduce", grad * elements, n, span)

    scatter = ((lambda e: scatter_cost(costs, e, n, span, grad)) if training.zero3_impl == CONTIGUOUS else None)
    done = walk(trace(model, layout), compute, lambda e: gather_cost(costs, e, n, span), reduce_s, scatter)
    return max(0.0, done.seconds - rank.forward - rank.backward)
