"""``estimate``: memory, step time and utilisation of one layout, with the pipeline from plait.sim."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from plait.errors import ConfigError
from plait.plan import memory as mem
from plait.plan import timing
from plait.plan.config import Cluster, Layout, Training, check, microbatches, runtime_gap
from plait.plan.model import Model
from plait.plan.pipeline import ROUND_SCHEDULES, PipelineProfile, profile

SPLIT_BACKWARD = {"zb-h1", "zbv", "dualpipev"}


@dataclass(frozen=True)
class Estimate:
    """What one layout costs.

    ``time`` splits ``step_time_s`` into compute, tp_comm, recompute, pp_bubble (idle time of the
    busiest rank, point-to-point waits included), dp_comm (exposed part), zero_comm (ZeRO-2/3 per-micro-batch traffic
    beyond the compute it overlaps) and optimizer;
    ``p2p_s`` is one stage-to-stage transfer. ``memory`` is the most loaded GPU.
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
    #: how interleaved-1f1b / ZB1P group micro-batches when M % pp != 0 ("equal" or "padded"; see
    #: ``plait.schedules.build_schedule``), None for the other schedules
    rounds: str | None = None

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
            "tokens_per_s": self.tokens_per_s, "notes": list(self.notes), "rounds": self.rounds,
            "runnable": self.layout.runnable, "plan_only_reason": runtime_gap(self.layout),
        }


def _pipeline(layout: Layout, m: int, costs: timing.StageCosts, exact: bool,
              rounds: str | None = None) -> PipelineProfile:
    weight = costs.weight if layout.schedule in SPLIT_BACKWARD else None
    return profile(layout.schedule, layout.pp, m, layout.virtual, costs.forward, costs.backward,
                   weight, costs.p2p, exact=exact, rounds=rounds)


def _pipeline_and_memory(model: Model, cluster: Cluster, layout: Layout, m: int, costs: timing.StageCosts,
                         exact: bool) -> tuple[PipelineProfile, mem.Memory, str | None]:
    """The pipeline profile and memory; for interleaved-1f1b / ZB1P with M % pp != 0 the rounds too:
    equal rounds (the closed-form bubble) unless only padded ones (fewer micro-batches held) fit."""
    pipe = _pipeline(layout, m, costs, exact)
    memory = mem.memory(model, cluster, layout, list(pipe.peak))
    if layout.schedule not in ROUND_SCHEDULES or layout.pp == 1 or layout.virtual == 1:
        return pipe, memory, None
    if memory.fits or m % layout.pp == 0 or m < layout.pp:
        return pipe, memory, "equal"
    padded = _pipeline(layout, m, costs, exact, rounds="padded")
    memory_padded = mem.memory(model, cluster, layout, list(padded.peak))
    return (padded, memory_padded, "padded") if memory_padded.fits else (pipe, memory, "equal")


def estimate(model: Model, cluster: Cluster, layout: Layout, training: Training,
             exact: bool = False) -> Estimate:
    """Estimate one layout. Raises ConfigError if the layout is invalid for this model and cluster
    (an over-full memory is not an error: see ``Estimate.fits``). ``exact`` simulates every
    micro-batch instead of extrapolating (see ``plait.plan.pipeline``)."""
    bad = check(model, cluster, layout, training)
    if bad:
        raise ConfigError(bad[1])
    return _estimate(model, cluster, layout, training, exact)


def _estimate(model: Model, cluster: Cluster, layout: Layout, training: Training,
              exact: bool = False) -> Estimate:
    m = microbatches(layout, training)
    costs = timing.stage_costs(model, cluster, layout)
    pipe, memory, rounds = _pipeline_and_memory(model, cluster, layout, m, costs, exact)
    dense, expert = mem._rank_params(model, layout, costs.layers, layout.pp == 1, layout.pp == 1)
    params = dense + expert
    dp = timing.dp_sync_time(model, cluster, layout, params)
    overlap = costs.backward if training.overlap_grad_reduce else 0.0
    dp_exposed = max(0.0, dp - overlap)
    per_mb = timing.zero_per_microbatch(cluster, layout, params)
    zero_comm = m * max(0.0, per_mb - costs.forward - costs.backward)
    opt = timing.optimizer_time(cluster, layout, params)
    busy = m * (costs.forward + costs.backward)
    step = pipe.makespan + dp_exposed + zero_comm + opt
    time = {
        "compute": m * 3 * costs.f_compute,
        "tp_comm": m * 2 * costs.f_tp,
        "recompute": m * costs.recompute,
        "pp_bubble": max(0.0, pipe.makespan - busy),
        "dp_comm": dp_exposed,
        "zero_comm": zero_comm,
        "optimizer": opt,
    }
    flops = timing.model_flops_per_step(model, training.global_batch)
    tflops = flops / step / cluster.n_gpus / 1e12
    return Estimate(
        model=model, cluster=cluster, layout=layout, training=training, step_time_s=step,
        tflops_per_gpu=tflops, mfu=tflops * 1e12 / cluster.gpu.peak_flops, memory=memory, time=time,
        microbatches=m, bubble_fraction=pipe.bubble_fraction, peak_in_flight=max(pipe.peak),
        p2p_s=costs.p2p, rounds=rounds,
    )
