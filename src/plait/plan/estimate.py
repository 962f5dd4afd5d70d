"""``estimate``: memory, step time and utilisation of one layout, with the pipeline from plait.sim."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from plait.errors import ConfigError
from plait.plan import memory as mem
from plait.plan import step_end, timing, zero3_deepspeed
from plait.plan.cluster import Cluster
from plait.plan.config import Layout, Training, check, microbatches, runtime_gap
from plait.plan.costs import StageCosts
from plait.plan.model import Model
from plait.plan.overlap import dp_exposed
from plait.plan.pipeline import ROUND_SCHEDULES, SPLIT_BACKWARD, PipelineProfile, profile
from plait.plan.stages import layout_stages

# What the parts of ``Estimate.time`` are (they add up to the step).
PARTS = {
    "compute": "compute (with the weight gradients' accumulation)",
    "tp_comm": "tensor-parallel communication", "recompute": "recomputation",
    "cpu_sharing": "waiting for a CPU core (processes outnumber cores)", "pp_bubble": "pipeline bubble",
    "dp_comm": "exposed gradient reduction", "zero_comm": "ZeRO-3 per-micro-batch communication",
    "optimizer": "optimizer step",
    "sync": "per-step small collectives: the TP-partial gradients', the loss's and the gradient norm's sums",
}
# When in a step the runtime spends each part: ``Estimate.phases`` (plait train measures the same three).
PHASES = {
    "forward_backward": "the schedule's forwards and backwards, to this rank's last action",
    "grad_reduction": "waiting for the DP gradient reduction (ZeRO: its reduce-scatter), the sum over TP of the "
                      "gradients each TP rank holds part of, and the loss's sum",
    "optimizer": "the gradient norm's sum, the optimizer step and, under ZeRO-1/2, the weights' all-gather and "
                 "copies into the parameters",
}


@dataclass(frozen=True)
class Estimate:
    """What one layout costs.

    ``time`` splits ``step_time_s`` into parts that add up to it: compute, tp_comm, recompute and
    cpu_sharing (the average pipeline rank's busy time), pp_bubble (its idle time: the makespan of the
    forward/backward schedule less its busy time, point-to-point waits included), dp_comm (exposed
    part), zero_comm (ZeRO-3 per-micro-batch traffic beyond the compute it overlaps), optimizer and
    sync. ``bubble_fraction`` is the idle share of the step, ``pp_bubble / step_time_s``: the one
    definition of the bubble everywhere in plait. ``memory`` is the most loaded GPU, ``rank_memory``
    every pipeline rank; ``p2p_s`` is one stage-to-stage transfer.
    """

    model: Model
    cluster: Cluster
    layout: Layout
    training: Training
    step_time_s: float
    tflops_per_gpu: float
    mfu: float
    memory: mem.Memory
    time: dict[str, float]
    microbatches: int
    bubble_fraction: float
    peak_in_flight: float
    p2p_s: float
    notes: list[str] = field(default_factory=list)
    rank_memory: list[mem.Memory] = field(default_factory=list)
    #: how interleaved-1f1b / ZB1P group micro-batches when M % pp != 0 ("equal" or "padded"; see
    #: ``plait.schedules.build_schedule``), None for the other schedules
    rounds: str | None = None
    #: ``step_time_s`` split by when the runtime spends it (keys and meaning: ``PHASES``)
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def tokens_per_s(self) -> float:
        return self.training.global_batch * self.model.seq_len / self.step_time_s

    def to_dict(self) -> dict:
        return {
            "layout": asdict(self.layout), "step_time_s": self.step_time_s,
            "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, "fits": self.fits,
            "memory": asdict(self.memory), "time": dict(self.time), "microbatches": self.microbatches,
            "bubble_fraction": self.bubble_fraction, "peak_in_flight": self.peak_in_flight,
            "tokens_per_s": self.tokens_per_s, "global_batch": self.training.global_batch,
            "rank_memory": [asdict(m) for m in self.rank_memory], "notes": list(self.notes), "rounds": self.rounds,
            "phases": dict(self.phases),
            "runnable": self.layout.runnable, "plan_only_reason": runtime_gap(self.layout),
        }


def _pipeline_and_memory(model: Model, cluster: Cluster, layout: Layout, training: Training, exact: bool
                         ) -> tuple[list[StageCosts], PipelineProfile, list[mem.Memory], str | None]:
    """Chunk costs, the pipeline profile and every rank's memory; for interleaved-1f1b / ZB1P with
    M % pp != 0 the rounds too: equal rounds (the smaller bubble) unless only padded ones (fewer
    micro-batches held) fit."""

    def run(rounds: str | None) -> tuple[list[StageCosts], PipelineProfile, list[mem.Memory]]:
        chunks, pipe = pipeline(model, cluster, layout, training, exact, rounds)
        acts = mem.activations(cluster, model, layout, training)
        return chunks, pipe, mem.rank_memory(model, cluster, layout, list(pipe.peak_bytes), acts, training.precision,
                                             microbatches(layout, training), training.grad_dtype,
                                             training.zero3_impl, training.masters, training.loss)

    chunks, pipe, memory = run(None)
    if layout.schedule not in ROUND_SCHEDULES or layout.pp == 1 or layout.virtual_stages == 1:
        return chunks, pipe, memory, None
    m = microbatches(layout, training)
    if all(x.fits for x in memory) or m % layout.pp == 0 or m < layout.pp:
        return chunks, pipe, memory, "equal"
    chunks_p, pipe_p, memory_p = run("padded")
    if all(x.fits for x in memory_p):
        return chunks_p, pipe_p, memory_p, "padded"
    return chunks, pipe, memory, "equal"


def estimate(model: Model, cluster: Cluster, layout: Layout, training: Training,
             exact: bool = False) -> Estimate:
    """Estimate one layout. Raises ConfigError if the layout is invalid for this model and cluster
    (an over-full memory is not an error: see ``Estimate.fits``). ``exact`` simulates every
    micro-batch instead of extrapolating (see ``plait.plan.pipeline``)."""
    bad = check(model, cluster, layout, training)
    if bad:
        raise ConfigError(bad[1])
    m = microbatches(layout, training)
    costs = cluster.costs
    chunks, pipe, memory, rounds = _pipeline_and_memory(model, cluster, layout, training, exact)
    ranks = timing.rank_costs(costs, model, layout, training, m)
    pp = layout.pp
    busy = {"compute": m * sum(c.f_compute + c.b_compute for c in ranks) / pp,
            "tp_comm": m * sum(c.f_tp + c.b_tp for c in ranks) / pp,
            "recompute": m * sum(c.recompute for c in ranks) / pp, "cpu_sharing": 0.0}
    span = costs.forward_backward(model, layout, training.precision, chunks, m, rounds, pipe.makespan)
    busy["cpu_sharing"] = max(0.0, span.busy - sum(busy.values()))
    dense, expert = mem.max_rank_split(model, layout)
    params = dense + expert
    reduction, gather = step_end.dp_sync_parts(model, cluster, layout, params, training.grad_dtype, expert,
                                                  training.optimizer)
    busiest = max(ranks, key=lambda c: c.forward + c.backward)
    gather_3, scatter_3 = step_end.zero3_collectives(cluster, layout, params, step_end.zero3_units(model, layout),
                                                     training.grad_dtype, expert)
    if layout.zero == 3 and training.zero3_impl in zero3_deepspeed.IMPLS:
        # DeepSpeed v0.3.13's ZeRO-3 (plan.zero3_deepspeed): each micro-batch walks the same trace, its gradients'
        # all-reduces included (none left for the end of the step); after the step the persistent parameters'
        # gather
        zero3 = (m * zero3_deepspeed.exposed(model, cluster, layout, training, busiest)
                 + zero3_deepspeed.persistent_gather(costs, model, layout))
        reduction = 0.0
    else:
        # plait's ZeRO-3 (zero3_collectives): the gathers and reduce-scatters share one network, each beside the
        # compute of its own pass: a forward hides its gather; a backward its gather and reduce-scatter, the last
        # one's reduce-scatter (dp_sync_parts) only behind what of that backward its gather leaves free
        hide_f, hide_b = costs.hidden_reduction(busiest.forward), costs.hidden_reduction(busiest.backward)
        zero3 = (m * max(0.0, gather_3 - hide_f) + (m - 1) * max(0.0, gather_3 + scatter_3 - hide_b)
                 + max(0.0, gather_3 - hide_b))
    free = max(0.0, max(c.backward for c in ranks) - gather_3)
    reduction, gather = dp_exposed(costs, layout, training, reduction, gather, free, busiest.forward)
    layers = max(c.layers for c in ranks)
    optimizer = step_end.optimizer_time(cluster, layout, params, layers, training.optimizer, expert)
    publish = step_end.publish_time(cluster, layout, params, layers, training.precision, training.optimizer, expert)
    loss_sync, norm_sync = costs.step_syncs(model, layout)
    tp_sum = step_end.tp_partial_time(model, cluster, layout, layers, True, training.grad_dtype)
    tp_sum += step_end.tied_sum_time(model, cluster, layout, training.grad_dtype, training.tied_grad_sum)
    time = {**busy, "pp_bubble": max(0.0, span.makespan - sum(busy.values())), "dp_comm": reduction + gather,
            "zero_comm": zero3,
            "optimizer": span.stretch * optimizer + publish,
            "sync": tp_sum + loss_sync + norm_sync}
    ahead = gather if training.overlap_param_gather else 0.0  # waited for by the next step's first forwards
    phases = {"forward_backward": sum(time[k] for k in ("compute", "tp_comm", "recompute", "cpu_sharing",
                                                        "pp_bubble", "zero_comm")) + ahead,
              "grad_reduction": reduction + tp_sum + loss_sync,
              "optimizer": time["optimizer"] + gather - ahead + norm_sync}
    step = sum(time.values())
    flops = timing.model_flops_per_step(model, training.global_batch)
    tflops = flops / step / cluster.n_gpus / 1e12
    return Estimate(
        model=model, cluster=cluster, layout=layout, training=training, step_time_s=step,
        tflops_per_gpu=tflops, mfu=tflops * 1e12 / cluster.gpu.peak_flops,
        memory=max(memory, key=lambda x: x.total), time=time, microbatches=m,
        bubble_fraction=time["pp_bubble"] / step if step > 0 else 0.0, peak_in_flight=max(pipe.peak),
        p2p_s=chunks[0].p2p, rank_memory=memory, rounds=rounds, phases=phases,
    )


def pipeline(model: Model, cluster: Cluster, layout: Layout, training: Training,
             exact: bool = False, rounds: str | None = None) -> tuple[list[StageCosts], PipelineProfile]:
    """Per-chunk costs and the simulated forward/backward part of one step (activation bytes per chunk
    from ``plan.memory``); ``rounds``: see ``plait.schedules.build_schedule``."""
    m = microbatches(layout, training)
    chunks = timing.chunk_costs(cluster.costs, model, layout, training, m)
    acts = mem.activations(cluster, model, layout, training)
    layers = layout_stages(model, layout).chunk_layers
    nbytes = [acts.chunk(n, c == 0, c == len(layers) - 1) for c, n in enumerate(layers)]
    weight = [c.weight for c in chunks] if layout.schedule in SPLIT_BACKWARD else None
    pipe = profile(layout.schedule, layout.pp, m, layout.virtual_stages, [c.forward for c in chunks],
                   [c.backward for c in chunks], weight, chunks[0].p2p, nbytes, exact=exact, rounds=rounds)
    return chunks, pipe
