"""The cost model of a host ``plait calibrate`` measured: plait's own eager runtime on its measured kernels,
collectives, decoder layers, tensor-parallel layers and pipelines (``Cluster.from_profile``).

A layer's compute comes from the eager census (``census``) at the measured speeds (``compute``), its TP
collectives from the measured curves plus what a TP layer waited beyond them (``tp_wait``), an MoE layer's
all-to-alls from the measured curves (``_expert_exchanges``), its activations tensor by tensor as autograd saves
them; processes that outnumber the cores share them (``sharing``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from plait.errors import ConfigError
from plait.plan import experts
from plait.plan.accumulation import RUNTIME_ACCUMULATION
from plait.plan.catalogue import GPU, Link
from plait.plan.config import TE_OVERLAP_SMS, Layout
from plait.plan.costs import Blocks, Span, StageCosts
from plait.plan.documents import DocumentLengths, masked_attention
from plait.plan.host import census, sharing
from plait.plan.host import context as cp_host
from plait.plan.host.compute import in_step, in_step_costs, selective_recompute, work_costs
from plait.plan.host.documents import masked_work
from plait.plan.host.profile import HostProfile, Section
from plait.plan.host.shapes import block_local
from plait.plan.memory import ACTIVATION_BYTES, ActivationModel, zero3_working
from plait.plan.model import Model
from plait.plan.optimizers import RUNTIME_OPTIMIZER
from plait.plan.timing import layer_gemms, recomputed_gemms

# plait's optimizer step in fp32 (plait.optim.build_optimizer), bytes per parameter when a profile did not time
# it (format 1): the global norm casts each gradient to float64 a chunk at a time (read 4, write 8, the dot
# reads 8), the clip scales the gradients (read + write 8), torch's fused AdamW reads p, g, m, v and writes
# p, m, v in one pass (28). Profiles of format >= 2 time the step itself (Section.optimizer_s_per_param).
EAGER_OPTIMIZER_TRAFFIC = 56.0
EAGER_OPTIMIZER_OPS = 6  # kernels per parameter tensor: the norm's reshape, cast, dot and sum; clip; AdamW


def eager_activations(model: Model, layout: Layout, precision: str) -> ActivationModel:
    """What plait's eager runtime saves for backward under ``layout`` at ``precision``, tensor by tensor
    (``census``): bytes of a layer, the embedding and the head per micro-batch, the working set and the
    RoPE tables the layers share. It needs no host profile (what autograd saves does not depend on the host's
    speeds); on one pipeline stage with one micro-batch in flight, ``.chunk(model.n_layers, True, True) +
    .shared`` is what ``pm.memory_report()`` reports as ``activations_peak``."""
    working = zero3_working(model, layout, precision)
    sh = census.local(model, layout)
    d = ACTIVATION_BYTES[precision]
    tables = census.rope_tables_saved(sh) * d
    if layout.recompute == "full":  # the tables are saved inside the checkpoints: by the recomputed layer only
        working += census.layer_saved(sh, dtype_bytes=d) * d + tables
        return ActivationModel(census.checkpoint_saved(sh) * d, census.embedding_saved(sh) * 4,
                               (2 * sh.n_local * d + (sh.tokens * sh.vocab + 2.5 * sh.tokens) * 4), working)
    layer = census.layer_saved(sh, selective=layout.recompute == "selective", dtype_bytes=d) * d
    return ActivationModel(layer, census.embedding_saved(sh) * 4, census.head_saved(sh, d) * d, working, tables)


def host_gpu(profile: HostProfile, processes: int) -> GPU:
    """A catalogue-style entry for one process of a calibrated host: its measured matmul speed with every
    process computing, its share of the host's memory, the all-reduce of the largest group as its link."""
    sec = profile.section(processes)
    flops = sec.rates["matmul"].at(float("inf"), shared=True)  # the largest GEMM measured
    mem = float(profile.host.get("memory_bytes", 0)) / processes
    curves = sorted((g, c) for (op, g), c in sec.collectives.items() if op == "all_reduce")
    link = Link("measured all-reduce", curves[-1][1].bandwidth, curves[-1][1].latency) if curves else \
        Link("shared memory", 1e9, 1e-4)
    return GPU(f"{profile.name}:{processes}p", flops, mem, sec.memory_bandwidth, link, link, 1.0,
               f"{profile.host.get('cpu', 'host')}, {processes} processes x {sec.threads} threads (calibrated)")


@dataclass(frozen=True)
class HostCosts:
    """The ``CostModel`` of ``processes`` plait processes on the host of ``profile``. Compute is costed at the
    speeds one process gets while the others wait, or with ``shared`` while every process computes
    (``shared_twin``: what ``sharing`` runs the schedule with)."""

    profile: HostProfile
    processes: int
    shared: bool = False
    #: plait train gathers its fp32 weights
    weight_gather_bytes: int = 4

    @cached_property
    def section(self) -> Section:
        """The calibrated host's measurements for this many processes."""
        return self.profile.section(self.processes)

    @property
    def cores(self) -> float:
        """The host's cores over the threads each process runs: the most processes that compute at once at their
        speed alone."""
        return self.profile.cores / self.section.threads

    def shared_twin(self) -> HostCosts:
        return replace(self, shared=True)

    def collective(self, op: str, nbytes: float, n: int, span: int | None = None) -> float:
        """As measured (every group of the size busy at once)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return self.section.collective(op, n, nbytes)

    def _layer_collectives(self, sh: census.Local, n_bytes: float) -> tuple[float, float, int, int]:
        """(forward seconds, backward seconds, forward count, backward count) of one layer's TP collectives, timed
        back to back: 2 regions, an all-reduce out (g) and, in backward, in (f); SP: gather in, scatter out, and in
        backward each region's input gathered again (``census.Local.regathers``)."""
        t = sh.tp
        if sh.sp:
            gather = self.collective("all_gather", n_bytes, t)
            f = 2 * (gather + self.collective("reduce_scatter", n_bytes, t))
            return f, f + sh.regathers * gather, 4, 4 + sh.regathers
        f = 2 * self.collective("all_reduce", n_bytes, t)
        return f, f, 2, 2

    def tp_wait(self, tp: int, sp: bool, n_bytes: float) -> float:
        """Seconds each TP collective of a run waits beyond its back-to-back time, for an activation of
        ``n_bytes`` (``[b, s, h]`` in full), on a host that timed a tensor-parallel layer over ``tp`` ranks
        (``plait.calibrate.tp_block``; else 0). At each size timed, the layer less its compute twin (timed in
        alternating rounds) is what its collectives took inside a run; less the same collectives as the
        profile's curves time them back to back, per collective, it is that size's wait. Between and beyond the
        smallest and largest size timed it is the line through those two (one size timed: its wait). Where
        processes outnumber cores it is mostly the time a rank waits for a peer the scheduler has not run yet,
        or for a core once its peers' data arrived; it grows with the bytes (in a run the collective's buffers
        come cold from compute, not hot from the last call of a tight loop). It is negative where a curve came
        out above what the layer showed (the curves are short tight loops, the noisier figure): the layer's
        collectives then cost what the layer showed (``_block`` floors a block's collectives at 0)."""
        if tp <= 1:
            return 0.0
        sec = self.section
        # the other form stands in where one was not timed (an older quick calibration timed no SP)
        blocks = [b for b in sec.tp_blocks if b.group == tp and b.sequence_parallel == sp] or \
            [b for b in sec.tp_blocks if b.group == tp]
        points = []
        for blk in blocks:
            sh = block_local(blk.shape, tp, blk.sequence_parallel)
            f_tp, b_tp, nf, nb = self._layer_collectives(sh, sh.n * 4)  # fp32, as timed
            points.append((sh.n * 4, (blk.seconds - blk.twin_s - f_tp - b_tp) / (nf + nb)))
        if not points:
            return 0.0
        (x0, y0), (x1, y1) = min(points), max(points)
        if x1 == x0:
            return y0
        return y0 + (y1 - y0) * (n_bytes - x0) / (x1 - x0)

    def _expert_exchanges(self, model: Model, layout: Layout, n_bytes: float) -> tuple[float, float]:
        """(forward, backward) seconds of an MoE layer's all-to-alls over its EP group as measured
        (``plait.experts.dispatch``): forward the per-expert counts (E int64), the token rows out and the results
        back; backward the two row exchanges reversed. The rows the busiest rank receives (``plan.experts.dispatch``:
        a rank's dispatched tokens once per routed expert, times ``plan.experts.received``), which the group waits
        for. Its TP collectives are costed as the dense MLP's."""
        ep = layout.ep
        if not model.is_moe or ep <= 1:
            return 0.0, 0.0
        rows = 2 * self.collective("all_to_all", experts.dispatch(model, layout, n_bytes)[0], ep)
        return self.collective("all_to_all", 8 * model.n_experts, ep) + rows, rows

    def _not_recomputed(self, model: Model, layout: Layout, sh: census.Local, work: census.Work, f_compute: float,
                        n_bytes: float, wait: float) -> tuple[float, float]:
        """(compute, TP seconds) of a layer's forward that an early-stopping full recomputation does not run again
        (``timing.recomputed_gemms``): the GEMMs it skips, as their share of the layer's forward ``work`` by the
        host's own figures (their seconds at the measured matmul rate for their shapes over what the kernel figures
        give the whole forward) of ``f_compute``, the forward as a step runs it; after a dense layer's last GEMM,
        its TP reduction (an all-reduce; SP's reduce-scatter) with its ``wait``."""
        skipped = layer_gemms(model, layout)[len(recomputed_gemms(model, layout, True)):]
        if not skipped:
            return 0.0, 0.0
        sec, mm = self.section, self.section.rates["matmul"]
        gemm = sum(count * 2 * m * n * k / mm.at(2 * m * n * k, self.shared) for m, n, k, count in skipped)
        forward = work_costs(work, sec, self.shared, layer=True).f_compute
        tp = self.collective("reduce_scatter" if sh.sp else "all_reduce", n_bytes, layout.tp) + wait \
            if layout.tp > 1 else 0.0
        return f_compute * min(1.0, gemm / forward), tp

    def _head_recomputed(self, sh: census.Local, work: census.Work, dtype_bytes: int, f_compute: float,
                         n_bytes: float, wait: float) -> float:
        """What an early-stopping full recomputation runs again of the head: plait checkpoints the final norm and
        the output layer as blocks of their own, and the output layer's GEMM saves its input (under SP gathered
        inside it: the gather runs again, with its ``wait``), so only the norm (charged whole: its last multiply,
        by the weight, is not run again) and that gather; the loss is outside both. The norm's share of the head's
        forward ``work`` (at ``dtype_bytes``) by the host's kernel figures, of ``f_compute``."""
        sec = self.section
        norm = work_costs(census.final_norm_work(sh, dtype_bytes), sec, self.shared).f_compute
        share = min(1.0, norm / work_costs(work, sec, self.shared).f_compute)
        gather = max(0.0, self.collective("all_gather", n_bytes, sh.tp) + wait) if sh.sp else 0.0
        return f_compute * share + gather

    def _block(self, kind: str, model: Model, layout: Layout, precision: str, early_stop: bool = True,
               documents: DocumentLengths | None = None) -> StageCosts:
        """A layer, the head or the embedding of plait's eager Llama: kernels and TP collectives (each with its
        wait for the slowest rank, ``tp_wait``); under full recomputation its forward again, up to its last saved
        tensor with ``early_stop`` (a layer: ``_not_recomputed``; the head: ``_head_recomputed``; the embedding:
        nothing). A layer's attention core under document masking as ``documents`` cut the rows
        (``plan.host.documents.masked_work``)."""
        sec, shared = self.section, self.shared
        sh = census.local(model, layout)
        d = ACTIVATION_BYTES[precision]
        t, n_bytes = layout.tp, sh.n * d
        work = {"layer": census.layer_work, "head": census.head_work, "embedding": census.embedding_work}[kind](sh, d)
        if kind == "layer" and documents is not None:
            work = masked_work(work, documents, masked_attention(documents, model, layout, d), layout, sh, d,
                               str(self.profile.host.get("device", "cpu")))
        cp_f = cp_b = cp_xf = cp_xb = 0.0
        if kind == "layer" and layout.cp > 1:  # blockwise attention, not SDPA, and its K/V exchange (plan.host.context)
            work = replace(work, attention=0.0)
            cp_f, cp_b = self._cp_attention(model, sh, work)
            cp_xf, cp_xb = cp_host.exchange(sh, sec, d)
        c = in_step_costs(work, sec, shared, layer=kind == "layer", tp=t)
        c = replace(c, f_compute=c.f_compute + cp_f, b_compute=c.b_compute + cp_b)
        wait = self.tp_wait(t, sh.sp, n_bytes)
        if kind == "layer":
            f_tp, b_tp, nf, nb = self._layer_collectives(sh, n_bytes)
        elif kind == "head":  # the loss's max and sums ([T] and [2, T]); in backward the input's gradient
            f_tp = self.collective("all_reduce", 4 * sh.tokens, t) + self.collective("all_reduce", 8 * sh.tokens, t)
            f_tp += self.collective("all_gather", n_bytes, t) if sh.sp else 0.0
            b_tp = self.collective("reduce_scatter" if sh.sp else "all_reduce", n_bytes, t)
            nf, nb = 3 if sh.sp else 2, 1
        else:  # the embedding's partial rows summed (reduce-scattered under SP)
            f_tp, b_tp = self.collective("reduce_scatter" if sh.sp else "all_reduce", n_bytes, t), 0.0
            nf, nb = 1, 0
        if t > 1:
            f_tp, b_tp = max(0.0, f_tp + nf * wait), max(0.0, b_tp + nb * wait)
        if kind == "layer":
            f_a2a, b_a2a = self._expert_exchanges(model, layout, n_bytes)
            f_tp, b_tp = f_tp + f_a2a, b_tp + b_a2a
        f_tp, b_tp = f_tp + cp_xf, b_tp + cp_xb
        recompute = c.f_compute + f_tp if layout.recompute == "full" else 0.0
        if layout.recompute == "full" and early_stop:
            if kind == "layer":
                skipped, skipped_tp = self._not_recomputed(model, layout, sh, work, c.f_compute, n_bytes, wait)
                recompute = c.f_compute - skipped + max(0.0, f_tp - skipped_tp)
            elif kind == "head":
                recompute = self._head_recomputed(sh, work, d, c.f_compute, n_bytes, wait)
            else:  # nothing in the embedding's checkpoint saves the rows it looks up
                recompute = 0.0
        # the attention core again, under its checkpoint (context parallelism's core replaces it: nothing again)
        if kind == "layer" and layout.recompute == "selective" and layout.cp == 1:
            measured = selective_recompute(sec, shared, sh)
            attn = sec.rates["attention"]  # an older profile: the core's forward by the kernel figures
            recompute = measured if measured is not None else \
                work.attention / attn.at(work.attention_size, shared) * attn.forward_share
        return StageCosts(c.f_compute, c.b_compute, c.w_compute, f_tp, b_tp, recompute, 0.0,
                          1 if kind == "layer" else 0)

    def _cp_attention(self, model: Model, sh: census.Local, work: census.Work) -> tuple[float, float]:
        """A layer's CP attention core (``plan.host.context.attention``; its windowed layers' and the others'
        averaged by their share), at the level real layers run kernels in a step (``in_step``, at the whole
        layer's seconds by the kernel figures alone), as the rest of the layer is."""
        sec, share = self.section, model.window_layer_share

        def core(shared: bool) -> tuple[float, float]:
            full = cp_host.attention(sh, sec, shared, None)
            if share == 0.0:
                return full
            windowed = cp_host.attention(sh, sec, shared, model.sliding_window)
            return (share * windowed[0] + (1 - share) * full[0], share * windowed[1] + (1 - share) * full[1])

        alone, here = core(False), core(self.shared)
        rest = work_costs(work, sec, False, layer=True)
        x = in_step(sec, self.shared, rest.f_compute + rest.b_compute + sum(alone))
        return here[0] * x, here[1] * x

    def blocks(self, model: Model, layout: Layout, precision: str, tp_overlap: bool = False,
               overlap_sms: tuple[int, int] = TE_OVERLAP_SMS, elementwise: str = "fused",
               sp_async: bool = False, early_stop: bool = True, documents: DocumentLengths | None = None) -> Blocks:
        """As plait runs a layer here: its TP collectives exposed (``tp_overlap``, ``overlap_sms`` and ``sp_async``
        model other stacks' overlaps on catalogue GPUs, which plait's runtime does not run); its element-wise
        kernels are in the measured layer times whatever ``elementwise`` says; ``early_stop``
        (``Training.recompute_early_stop``): a layer's full recomputation less what torch does not run again;
        ``documents``: a layer's attention under document masking (``_block``)."""
        for name, given in (("tp_comm_overlap", tp_overlap), ("sp_async_backward", sp_async)):
            if given:
                raise ConfigError(f"{name}: models another stack's overlap on catalogue GPUs; a calibrated host runs "
                                  f"plait's own collectives (use {name}=False)")
        return Blocks(*(self._block(k, model, layout, precision, early_stop, documents)
                        for k in ("layer", "embedding", "head")))

    def p2p(self, model: Model, layout: Layout, precision: str) -> float:
        """As measured, the whole activation (plait sends it unscattered)."""
        if layout.pp == 1:
            return 0.0
        tokens = layout.microbatch_size * model.seq_len / layout.cp
        return self.collective("p2p", tokens * model.hidden * ACTIVATION_BYTES[precision], 2)

    def activations(self, model: Model, layout: Layout, precision: str,
                    elementwise: str = "plait-eager") -> ActivationModel:
        """plait's eager runtime tensor by tensor (``eager_activations``: no measured figure enters), whatever
        ``elementwise`` says."""
        return eager_activations(model, layout, precision)

    def hidden_reduction(self, backward: float) -> float:
        """None: the reduction's copies, sums and socket work run on the same cores the backward fills (plait
        calibrate gives every process its share of the cores), so the time moves but does not vanish. On a
        two-core host, pp2·dp2's ranks waited 10-55 ms per step for their last bucket's reduction, and the step
        ran 753 ms where the prediction with the reduction hidden said 695."""
        return 0.0

    def optimizer_time(self, params: float, tensors: int, shards: float, optimizer: str = RUNTIME_OPTIMIZER) -> float:
        """plait's step as ``plait calibrate`` timed it, per parameter and per tensor it updates, or per
        parameter alone (older profiles); profiles of format 1: its bytes at the streaming bandwidth and a few
        kernels per parameter tensor. Another stack's ``optimizer``: ConfigError (the host times plait's own)."""
        if optimizer != RUNTIME_OPTIMIZER:
            raise ConfigError(f"optimizer: {optimizer!r} is costed on catalogue GPUs; a calibrated host times plait's "
                              f"own step (use optimizer={RUNTIME_OPTIMIZER!r})")
        sec = self.section
        if sec.optimizer_s_per_param > 0:  # timed by plait calibrate
            return (sec.optimizer_s_per_param * params + sec.optimizer_s_per_tensor * tensors) / shards
        return (EAGER_OPTIMIZER_TRAFFIC * params / shards / sec.memory_bandwidth
                + EAGER_OPTIMIZER_OPS * tensors * sec.op_overhead_s * sec.rates["elementwise"].forward_share)

    def stream_time(self, nbytes: float, kernels: float) -> float:
        """At the bandwidth of every process streaming at once, each copy kernel at a forward-only kernel's
        fixed cost."""
        sec = self.section
        return nbytes / sec.memory_bandwidth + kernels * sec.op_overhead_s * sec.rates["elementwise"].forward_share

    def accumulation_time(self, nbytes: float, grad_accumulation: str = RUNTIME_ACCUMULATION) -> float:
        """0: ``plait calibrate`` times each block's backward with its parameters' gradients accumulating as over a
        step's micro-batches (``plait.calibrate.kernels.block``), so plait's accumulation is in the block's time.
        Another stack's ``grad_accumulation``: ConfigError (the host times plait's own)."""
        if grad_accumulation != RUNTIME_ACCUMULATION:
            raise ConfigError(f"grad_accumulation: {grad_accumulation!r} is costed on catalogue GPUs; a calibrated "
                              f"host times plait's own (use grad_accumulation={RUNTIME_ACCUMULATION!r})")
        return 0.0

    def step_syncs(self, model: Model, layout: Layout) -> tuple[float, float]:
        """Both over every rank. The loss is summed over the world when DP replicas (or MoE's auxiliary losses,
        which every rank holds a part of) contribute to it; otherwise the last stage sends it point to point
        (about as cheap as nothing) or holds it already. The gradient norm is summed over the world whenever
        there is more than one rank. The stop-signal check after each step is not part of the step time
        ``plait train`` measures, so it is not counted."""
        world = layout.world
        if world == 1:
            return 0.0, 0.0
        one = self.collective("all_reduce", 16, world)
        loss = one if layout.dp * layout.cp > 1 or model.n_experts > 1 else 0.0
        return loss, one

    def forward_backward(self, model: Model, layout: Layout, precision: str, chunks: list[StageCosts], m: int,
                         rounds: str | None, makespan: float) -> Span:
        """The processes of one host share its cores: ``sharing.shared_host``."""
        return sharing.shared_host(self, model, layout, precision, chunks, m, rounds)
