"""``search``: enumerate layouts, reject the invalid and the over-full, rank the rest by step time."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from plait.errors import FieldError, is_integer
from plait.parallel_config import CP_COMMS, RECOMPUTE_MODES, ZERO3_SCHEDULES
from plait.plan import memory as mem
from plait.plan import step_end, timing
from plait.plan.cluster import Cluster
from plait.plan.config import RUNTIME, Layout, Training, check, microbatches
from plait.plan.costs import Blocks
from plait.plan.documents import DocumentLengths
from plait.plan.eager import ELEMENTWISE
from plait.plan.estimate import Estimate, estimate
from plait.plan.model import Model
from plait.plan.optimizers import MASTERS
from plait.plan.overlap import dp_exposed
from plait.plan.pipeline import makespan_floor
from plait.plan.stages import layout_stages

MICROBATCH_SIZES = (1, 2, 4)
T = TypeVar("T")

# Settings that can change nothing, each with its values simplest first: ZeRO-2 as plait runs it reduces the
# gradients once per step, as ZeRO-1 does (only the memory can differ); with fused (flash) attention the
# backward already recomputes the scores, so selective recomputation (Korthikanti et al. 2022, §4.3: redo
# QK^T, softmax and AV) redoes nothing. Layouts differing only in these that estimate the same step time
# are twins (``SearchResult.twins``): one is ranked.
TWIN_SETTINGS: dict[str, tuple] = {"zero": (1, 2), "recompute": ("none", "selective")}


@dataclass
class SearchResult:
    """``best``: fitting layouts, fastest first. ``rejected``: how many layouts failed, by reason
    (``check`` keys such as ``tp>node``, ``heads%tp``, ``layers<stages``, ``batch%dp``, plus
    ``memory``). ``pruned``: valid layouts never simulated because even with no pipeline bubble
    they would be slower than the ``top``-th best (branch and bound). ``considered``: all layouts.
    ``twins``: layouts left out for a twin, one that differs only in settings of ``TWIN_SETTINGS`` and takes
    exactly the same time with no more memory; of such layouts the one with less memory is ranked, else the
    simplest (ZeRO-1, no recomputation). ``twin_settings``: those counts by the settings told apart
    (``"zero"``, ``"recompute"`` or ``"zero+recompute"``)."""

    best: list[Estimate]
    rejected: Counter = field(default_factory=Counter)
    pruned: int = 0
    considered: int = 0
    smallest_memory: float = 0.0  # the least bytes any valid layout needs (at least), when nothing fits
    twins: int = 0
    twin_settings: Counter = field(default_factory=Counter)
    cp_searched: bool = False  # layouts with cp > 1 were among those considered (``searches_cp``)

    @property
    def ok(self) -> bool:
        return bool(self.best)

    # a SearchResult also reads as the ranked list of Estimates (``search(...)[0].layout``)
    def __iter__(self):
        return iter(self.best)

    def __len__(self) -> int:
        return len(self.best)

    def __getitem__(self, index):
        return self.best[index]


def _pow2_divisors_upto(n: int, limit: int) -> list[int]:
    return [d for d in (2**i for i in range(0, 20)) if d <= limit and n % d == 0]


def _divisors_upto(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


#: the shortest sequence whose layouts the search splits over context-parallel ranks
CP_MIN_SEQ_LEN = 32768


def searches_cp(model: Model, cluster: Cluster) -> bool:
    """Whether the search splits ``model``'s sequences over context-parallel ranks: from ``CP_MIN_SEQ_LEN`` tokens,
    where activations rather than weights decide what fits, and on catalogue GPUs at any length for a model with a
    sliding window, whose attention at cp = 1 computes the whole square behind an explicit mask and keeps that mask
    per layer, while context parallelism's attention skips the blocks outside the window (``plan.gpu``). A
    calibrated host's model does not time cp = 1's attention behind the window's mask (its SDPA figure is the
    causal kernel's), so there only from CP_MIN_SEQ_LEN."""
    return model.seq_len >= CP_MIN_SEQ_LEN or (model.window_layer_share > 0 and cluster.profile is None)


def candidates(model: Model, cluster: Cluster, training: Training, plan_only: bool = False) -> Iterator[Layout]:
    """Every layout the search considers (see docs/planner.md, "How it models a step": Search).

    Only what plait's runtime runs (``config.RUNTIME``: its recompute modes, ZeRO stages and schedules),
    unless ``plan_only``: then also what only the planner models (ZeRO-3 with pp > 1), marked plan-only
    (``Layout.runnable``). Context parallelism (both K/V exchanges) is searched where ``searches_cp`` says.
    SP is always on with TP (same communication volume, less memory: Korthikanti et al. 2022); with DP,
    ZeRO-0 is left out (a sharded optimizer moves no more than an all-reduce of the gradients, with less
    memory); GPipe is left out (1F1B has its bubble with less memory). An MoE model's experts are placed both
    ways the runtime runs at tp > 1, whole or split over TP (``_placements``, ``plan.experts``).
    """
    n = cluster.n_gpus
    cps = _pow2_divisors_upto(n, 16) if searches_cp(model, cluster) else [1]
    for tp in _pow2_divisors_upto(n, cluster.gpus_per_node * 2):
        for cp in cps:
            rest = n // tp
            if rest % cp:
                continue
            for pp in _divisors_upto(rest // cp, model.n_layers + 1):
                dp = rest // cp // pp
                yield from _variants(model, training, tp, pp, dp, cp, _placements(model, tp, dp * cp), plan_only)


def _placements(model: Model, tp: int, data: int) -> list[tuple[int, bool]]:
    """(ep, expert_tp) of an MoE model's layouts at ``tp`` over ``data`` = dp·cp ranks (``plan.experts``): whole
    experts over EP groups within the dp·cp·tp plane, and with tp > 1 experts split over TP, EP over dp·cp."""
    if not model.is_moe:
        return [(1, False)]
    whole = [(ep, False) for ep in _divisors_upto(model.n_experts, data * tp)]
    return whole + ([(ep, True) for ep in _divisors_upto(model.n_experts, data)] if tp > 1 else [])


def _variants(model: Model, training: Training, tp: int, pp: int, dp: int, cp: int,
              placements: list[tuple[int, bool]], plan_only: bool) -> Iterator[Layout]:
    scheds: list[tuple[str, int]] = [("1f1b", 1)]
    if pp > 1:
        scheds += [("zb-h1", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4), ("zbv", 2)]
    recomputes = RECOMPUTE_MODES if plan_only else RUNTIME["recompute"]
    sharded = (1, 2, 3) if plan_only else tuple(z for z in RUNTIME["zero"] if z > 0)
    zeros = sharded if dp * cp > 1 and sharded else (0,)
    for ep, expert_tp in placements:
        for mbs in MICROBATCH_SIZES:
            if training.global_batch % (dp * mbs):
                continue
            for sched, v in scheds:
                if not plan_only and sched not in RUNTIME["schedule"]:
                    continue
                for rc in recomputes:
                    for z in zeros:
                        if z == 3 and not plan_only and sched not in ZERO3_SCHEDULES:
                            continue  # runtime_gap: ZeRO-3 runs one chunk per rank without a split backward
                        for comm in CP_COMMS if cp > 1 else CP_COMMS[:1]:
                            yield Layout(tp=tp, pp=pp, dp=dp, cp=cp, cp_comm=comm, ep=ep, expert_tp=expert_tp,
                                         virtual_stages=v, microbatch_size=mbs, sequence_parallel=tp > 1,
                                         recompute=rc, zero=z, schedule=sched)


# The Layout fields each part of a bound that ``_Shared`` keeps reads: a cost model's ``blocks`` (a layer, the
# embedding and the head), ``memory.activations``, ``memory.max_rank_split`` and ``step_end.dp_sync_parts`` (with
# the parameters it is given). Layouts of one search equal in them share that part.
BLOCKS_FIELDS = ("tp", "cp", "cp_comm", "ep", "expert_tp", "microbatch_size", "sequence_parallel", "recompute")
ACTIVATIONS_FIELDS = (*BLOCKS_FIELDS, "zero")
PARAMS_FIELDS = ("tp", "pp", "ep", "expert_tp", "virtual_stages", "schedule", "partition")
SYNC_FIELDS = ("tp", "pp", "dp", "cp", "ep", "expert_tp", "zero")


@dataclass
class _Shared:
    """Parts of ``_lower_bounds`` that layouts of one search (one model, cluster and training) share: many differ
    only in ZeRO stage, schedule, pipeline or data-parallel size, micro-batch size or K/V exchange, which some
    parts do not read. Each part is found once per key (its ``*_FIELDS`` of the layout, and what else it is given).
    """

    model: Model
    cluster: Cluster
    training: Training
    found: dict[tuple, Any] = field(default_factory=dict)

    def _once(self, part: str, names: tuple[str, ...], layout: Layout, given: tuple, make: Callable[[], T]) -> T:
        key = (part, *(getattr(layout, f) for f in names), *given)
        if key not in self.found:
            self.found[key] = make()
        return self.found[key]

    def layer_blocks(self, layout: Layout) -> Blocks:
        return self._once("blocks", BLOCKS_FIELDS, layout, (), lambda: timing.layer_blocks(
            self.cluster.costs, self.model, layout, self.training))

    def activations(self, layout: Layout) -> mem.ActivationModel:
        return self._once("activations", ACTIVATIONS_FIELDS, layout, (), lambda: mem.activations(
            self.cluster, self.model, layout, self.training))

    def max_rank_split(self, layout: Layout) -> tuple[float, float]:
        return self._once("params", PARAMS_FIELDS, layout, (), lambda: mem.max_rank_split(self.model, layout))

    def dp_sync_parts(self, layout: Layout, params: float, expert: float) -> tuple[float, float]:
        t = self.training
        return self._once("sync", SYNC_FIELDS, layout, (params, expert), lambda: step_end.dp_sync_parts(
            self.model, self.cluster, layout, params, t.grad_dtype, expert, t.optimizer))


def _lower_bounds(model: Model, cluster: Cluster, layout: Layout, training: Training,
                  shared: _Shared | None = None) -> tuple[float, float]:
    """(seconds, bytes) no simulation can beat: the pipeline floor, exposed DP and the optimizer; the
    first chunk's rank holding its states plus min(pp, M) micro-batches of chunk 0 (every schedule here
    runs that many forwards of its first chunk before a backward). ``shared``: the search's parts shared between
    layouts (None: all found here)."""
    shared = shared if shared is not None else _Shared(model, cluster, training)
    m = microbatches(layout, training)
    chunks = timing.chunk_costs(cluster.costs, model, layout, training, m, shared.layer_blocks(layout))
    st = layout_stages(model, layout)
    dense, expert = shared.max_rank_split(layout)
    params = dense + expert
    reduction, gather = shared.dp_sync_parts(layout, params, expert)
    backward, forward = [0.0] * layout.pp, [0.0] * layout.pp  # a rank's passes over its chunks (``estimate``)
    for c, cost in enumerate(chunks):
        backward[st.placement[c]] += cost.backward
        forward[st.placement[c]] += cost.forward
    seconds = makespan_floor(layout.schedule, layout.pp, m, layout.virtual_stages, [c.forward for c in chunks],
                             [c.backward for c in chunks]) + sum(
        dp_exposed(cluster.costs, layout, training, reduction, gather, max(backward), max(forward)))
    layers = max(st.rank_layers)
    seconds += step_end.optimizer_time(cluster, layout, params, layers, training.optimizer, expert)
    seconds += step_end.publish_time(cluster, layout, params, layers, training.precision, training.optimizer,
                                     expert)
    r0 = st.first_rank
    states = sum(mem.state_bytes(model, layout, st.rank_layers[r0], True, r0 == st.last_rank, training.precision,
                                 training.grad_dtype, training.masters))
    acts = shared.activations(layout)
    first = acts.chunk(st.chunk_layers[0], True, len(st.chunk_layers) == 1)
    return seconds, states + min(layout.pp, m) * first


@dataclass
class _Bounded:
    """What a search finds before simulating anything, whatever its ``top``: the valid layouts that may fit with
    their (seconds, order, layout) lower bounds, fastest bound first, and the counts of the rest."""

    queue: list[tuple[float, int, Layout]]
    rejected: Counter
    considered: int
    smallest: float  # the least bytes a layout rejected on its bound needs (at least)


def _bounded(model: Model, cluster: Cluster, training: Training, plan_only: bool) -> _Bounded:
    usable = cluster.usable_memory
    found = _Bounded([], Counter(), 0, float("inf"))
    shared = _Shared(model, cluster, training)
    for i, layout in enumerate(candidates(model, cluster, training, plan_only)):
        found.considered += 1
        bad = check(model, cluster, layout, training)
        if bad:
            found.rejected[bad[0]] += 1
            continue
        seconds, need = _lower_bounds(model, cluster, layout, training, shared)
        if need > usable:  # a bound: the layout needs at least this, more than there is
            found.smallest = min(found.smallest, need)
            found.rejected["memory"] += 1
            continue
        found.queue.append((seconds, i, layout))
    found.queue.sort()
    return found


def search(model: Model, cluster: Cluster, training: Training, top: int = 5, plan_only: bool = False) -> SearchResult:
    """The ``top`` fastest layouts that fit (at most ``cluster.max_memory_fraction`` of each device), with the
    counts of the rest by reason. Only layouts plait's runtime runs, unless ``plan_only`` (see ``candidates``)."""
    _check_top(top)
    return _ranked(model, cluster, training, top, _bounded(model, cluster, training, plan_only))


def _check_top(top: int) -> None:
    """``top`` must be a count of layouts: an integer (numpy's too), not a bool."""
    if not is_integer(top) or top < 1:
        raise FieldError("top", top, "how many layouts to keep, must be >= 1")


def _ranked(model: Model, cluster: Cluster, training: Training, top: int, found: _Bounded) -> SearchResult:
    """``search``'s result from its bounds ``found`` (left as they are, so the same bounds rank at any ``top``):
    simulate the layouts in the order of their bounds until the ``top``-th best is faster than the next bound."""
    result = SearchResult(best=[], rejected=Counter(found.rejected), considered=found.considered,
                          cp_searched=searches_cp(model, cluster))
    smallest = found.smallest
    queue = found.queue
    kept: list[tuple[float, int, Estimate]] = []  # max-heap on (step time, candidate order) via negation
    twins: dict[tuple[Layout, float], Estimate] = {}  # (simplest twin, step time) -> the one ranked
    for j, (seconds, i, layout) in enumerate(queue):
        if len(kept) >= top and seconds > -kept[0][0]:
            result.pruned += len(queue) - j
            break
        est = estimate(model, cluster, layout, training)
        smallest = min(smallest, est.memory.total)
        if not est.fits:
            result.rejected["memory"] += 1
            continue
        if _twin_kept(kept, twins, est, result):
            continue
        heapq.heappush(kept, (-est.step_time_s, -i, est))  # on a tie the later candidate goes first
        if len(kept) > top:
            heapq.heappop(kept)
    result.best = [e for _, _, e in sorted(kept, key=lambda k: (-k[0], -k[1]))]
    result.smallest_memory = smallest
    return result


def _simplest(layout: Layout) -> Layout:
    """``layout`` with each setting of ``TWIN_SETTINGS`` it holds set to that setting's simplest value."""
    return replace(layout, **{k: v[0] for k, v in TWIN_SETTINGS.items() if getattr(layout, k) in v})


def _complexity(layout: Layout) -> tuple[int, ...]:
    """Where ``layout`` stands in each setting of ``TWIN_SETTINGS`` (0: the simplest value)."""
    return tuple(v.index(getattr(layout, k)) if getattr(layout, k) in v else 0 for k, v in TWIN_SETTINGS.items())


def _twin_kept(kept: list[tuple[float, int, Estimate]], twins: dict[tuple[Layout, float], Estimate],
               est: Estimate, result: SearchResult) -> bool:
    """True if ``est`` is left out for a twin (see ``TWIN_SETTINGS``: the same step time, no less memory, else
    no simpler); when ``est`` is the better of the two, the twin leaves ``kept``. Counts either."""
    key = (_simplest(est.layout), est.step_time_s)
    other = twins.get(key)
    if other is None:
        twins[key] = est
        return False
    result.twins += 1
    result.twin_settings["+".join(k for k in TWIN_SETTINGS
                                  if getattr(est.layout, k) != getattr(other.layout, k))] += 1
    if (est.memory.total, _complexity(est.layout)) >= (other.memory.total, _complexity(other.layout)):
        return True
    twins[key] = est
    kept[:] = [k for k in kept if k[2] is not other]
    heapq.heapify(kept)
    return False


# Global batches tried when none is given, in tokens: published runs use 4M (GPT-3 175B, Llama 2) to 16M
# (Llama 3 405B on 16k GPUs) and up to ~60M (DeepSeek-V3's last phase, 15,360 sequences of 4k).
DEFAULT_BATCH_TOKENS = (4 * 2**20, 8 * 2**20, 16 * 2**20, 32 * 2**20, 64 * 2**20)
DEFAULT_BATCH_BUBBLE = 0.10


@dataclass(frozen=True)
class BatchChoice:
    """The global batch ``search_batch`` chose and why (``reason``: one sentence for the user)."""

    global_batch: int
    reason: str
    result: SearchResult


def search_batch(model: Model, cluster: Cluster, top: int = 5, precision: str = "bf16",
                 max_bubble: float = DEFAULT_BATCH_BUBBLE, plan_only: bool = False,
                 elementwise: str = ELEMENTWISE[0], masters: str = MASTERS[0],
                 documents: DocumentLengths | None = None) -> BatchChoice:
    """Search the global batch too: the smallest of ``DEFAULT_BATCH_TOKENS`` (rounded to whole
    sequences) whose fastest layout keeps the pipeline bubble under ``max_bubble``; a larger batch only
    buys throughput at some cost in convergence. If none does, the largest that fits. ``precision``,
    ``elementwise`` and ``masters`` are the ``Training`` fields of every batch tried; ``documents``, its
    ``documents`` with document masking (None: without)."""
    _check_top(top)
    last: BatchChoice | None = None
    for tokens in DEFAULT_BATCH_TOKENS:
        batch = max(1, tokens // model.seq_len)
        training = Training(batch, precision=precision, elementwise=elementwise, masters=masters,
                            document_mask=documents is not None, documents=documents)
        found = _bounded(model, cluster, training, plan_only)  # the bounds do not depend on ``top``: found once
        result = _ranked(model, cluster, training, 1, found)  # probe: the best only
        if result.best and result.best[0].bubble_fraction < max_bubble or tokens == DEFAULT_BATCH_TOKENS[-1]:
            result = _ranked(model, cluster, training, top, found)
        if not result.best:
            last = last or BatchChoice(batch, f"{batch} sequences ({tokens / 2**20:.0f}M tokens): nothing fits", result)
            continue
        bubble = result.best[0].bubble_fraction
        what = f"{batch} sequences ({batch * model.seq_len / 2**20:.0f}M tokens)"
        if bubble < max_bubble:
            return BatchChoice(batch, f"{what}: the smallest published-practice batch (4-64M tokens) whose "
                                      f"best layout has a bubble under {max_bubble:.0%}", result)
        last = BatchChoice(batch, f"{what}: the largest published-practice batch (4-64M tokens); none keeps "
                                  f"the bubble under {max_bubble:.0%}", result)
    assert last is not None
    return last
