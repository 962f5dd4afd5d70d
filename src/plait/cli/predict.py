"""``plait train``'s predictor: what the planner (``plait.plan``) predicts for the run on this host, and the
host profile (``plait.calibrate``) it needs. The command installs it in the run (``plait.train.observe``).

``--cluster FILE`` names a profile from ``plait calibrate``. By default, on a host with a GPU the planner's
catalogue holds, the run is costed by the planner's GPU model (``plait.plan.gpu``) on that many of those GPUs;
on a CPU host this host's cached profile is used, and when it lacks the run's process count that section is
measured first, by the run's own processes (every other size of ``plait calibrate``'s, a few seconds; cached
for the next run; a later ``plait calibrate`` replaces it). ``--cluster none`` predicts nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from plait.errors import ConfigError
from plait.train.config import TrainConfig
from plait.train.observe import NO_CLUSTER, Prediction
from plait.words import counted

if TYPE_CHECKING:
    from plait.data.stream import TrainData
    from plait.plan.cluster import Cluster
    from plait.plan.config import Layout, Training
    from plait.plan.documents import DocumentLengths
    from plait.plan.estimate import Estimate
    from plait.plan.host.profile import HostProfile
    from plait.plan.model import Model
    from plait.train.loop import Run

OFF = NO_CLUSTER


def check_cluster(cfg: TrainConfig, world: int) -> None:
    """ConfigError naming --cluster if the given profile cannot predict a run of ``world`` processes."""
    if cfg.cluster in (None, OFF):
        return
    from plait.plan.host.profile import HostProfile

    HostProfile.load(cfg.cluster).section(world)


def gpu_cluster(world: int) -> Cluster | None:
    """``world`` GPUs of this host's kind (``LOCAL_WORLD_SIZE`` of them to a node, else all on this one), costed
    by the planner's GPU model with the attention kernel plait's SDPA calls run there (``plan.attention.
    sdpa_kernel``), when this host has a GPU; None on a CPU host. ConfigError when its GPU is not in the planner's
    catalogue (give --cluster none)."""
    from plait.devices import accelerator_name
    from plait.plan.attention import SDPA
    from plait.plan.catalogue import GPUS, gpu_of_device
    from plait.plan.cluster import Cluster

    name = accelerator_name()
    if name is None:
        return None
    gpu = gpu_of_device(name)
    if gpu is None:
        raise ConfigError(f"cluster: this host's GPU ({name}) is not in the planner's catalogue "
                          f"({', '.join(GPUS)}), so plait cannot predict its step; give --cluster none")
    return Cluster(gpu, world, gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                   flash_attention=SDPA)


def source_of(cluster: Cluster) -> str:
    """What a prediction on ``cluster`` was made with, as shown beside it."""
    from plait.plan.catalogue import get_gpu

    gpu = get_gpu(cluster.gpu)
    if cluster.profile is not None:
        return f"{gpu.name} (plait plan, host profile)"
    return f"{gpu.description or gpu.name} (plait plan, GPU model)"


def to_measure(cached, world: int) -> bool:
    """Whether a run of ``world`` processes measures this host beside the ``cached`` HostProfile (or None): it
    has no section of that many processes, or one of an older calibration (no whole decoder-layer timings, with
    and without the attention core recomputed, or a tensor-parallel layer timed at fewer sizes than this
    version times)."""
    from plait.calibrate.tp_block import group_sizes as tp_group_sizes
    from plait.plan.host.figures import SELECTIVE
    from plait.plan.host.shapes import TP_CALIBRATION_BLOCKS

    sec = None if cached is None else cached.sections.get(world)
    timed = set() if sec is None else {tuple(b.shape) for b in sec.tp_blocks}
    return (sec is None or SELECTIVE not in sec.rates
            or (world > 1 and bool(tp_group_sizes(world)) and not timed >= set(TP_CALIBRATION_BLOCKS)))


def several_hosts() -> bool:
    """Whether this run's workers span several hosts (torchrun's LOCAL_WORLD_SIZE below its WORLD_SIZE)."""
    return os.environ.get("LOCAL_WORLD_SIZE", "1") != os.environ.get("WORLD_SIZE", "1")


def unpredicted(cfg: TrainConfig, on_gpu: bool) -> str:
    """Why a run of ``cfg`` gets no prediction, should it get none (the words after "no prediction: ")."""
    if cfg.cluster == OFF:
        return "--cluster none"
    if several_hosts() and not on_gpu:
        return (f"the run spans several hosts ({os.environ.get('WORLD_SIZE')} processes, "
                f"{os.environ.get('LOCAL_WORLD_SIZE')} here) and a host profile describes one")
    if on_gpu:
        return "this host's GPU is not in the planner's catalogue"
    return "this host could not be measured"


def host_profile(cfg: TrainConfig, ctx):
    """The HostProfile for this run (collective over the world when it has to be measured), or None."""
    if cfg.cluster == OFF or several_hosts():
        return None  # turned off, or several hosts: a profile describes one
    from plait.plan.host.profile import HostProfile

    if cfg.cluster is not None:
        return HostProfile.load(cfg.cluster)
    import torch.distributed as dist

    from plait.calibrate import cache_path, host_facts
    from plait.calibrate.run import measure_in_world
    from plait.distributed.collectives import collective

    facts = host_facts()
    path = cache_path(facts)
    world = ctx.world_size
    cached = cached_profile(path)
    need = [to_measure(cached, world)]
    if world > 1:
        collective("broadcast of whether to measure this host (rank 0's cache decides for everyone)", None,
                   lambda: dist.broadcast_object_list(need, src=0))
    if not need[0]:
        return cached
    if ctx.rank == 0:  # the run's first lines wait for this: say why
        print(f"measuring this host with {counted(world, 'process')} for the prediction (once; "
              f"cached in {path}; --cluster none skips it) ...", flush=True)
    measured = measure_in_world([world], None, facts, quick=True)  # seconds; `plait calibrate` measures more
    if ctx.rank == 0 and measured is not None:
        profile = measured if cached is None else cached.merged(measured)
        try:
            profile.save(path)
        except OSError:  # an unwritable cache costs the next run a measurement, not this run its prediction
            pass
        return profile
    return None


def cached_profile(path: Path):
    """The profile cached at ``path``, or None when there is none or it cannot be read (an older format,
    a torn write): then it is measured again."""
    from plait.plan.host.profile import HostProfile

    try:
        return HostProfile.load(path) if path.is_file() else None
    except ConfigError:
        return None


def planner_inputs(cfg: TrainConfig, world: int, data: TrainData | None = None) -> tuple[Model, Layout, Training]:
    """The planner's (Model, Layout, Training) of this run of ``world`` processes; with --document-mask, as the
    documents of its data cut the rows (``data``, the run's, or opened here: raw text is tokenized)."""
    from plait.cli.auto_layout import plan_model
    from plait.plan.runs import train_layout

    documents = row_lengths(cfg, data) if cfg.document_mask else None
    return (plan_model(cfg), *train_layout(cfg.parallel.resolve(world), cfg.batch_size, cfg.document_mask,
                                           documents))


def row_lengths(cfg: TrainConfig, data: TrainData | None = None) -> DocumentLengths:
    """How the documents of the run's data (``data``, or ``--data`` opened here) cut its rows of --seq-len tokens
    (``plait.data.lengths``)."""
    from plait.data.lengths import row_documents
    from plait.data.stream import open_data
    from plait.plan.documents import DocumentLengths
    from plait.train.config import model_config

    if data is None:
        data = open_data(cfg.data, cfg.model, model_config(cfg).vocab_size, cfg.seq_len, cfg.batch_size, cfg.seed,
                         cfg.max_data_mb)
    return DocumentLengths(cfg.seq_len, *row_documents(data))


def predict(cfg: TrainConfig, profile, world: int, data: TrainData | None = None) -> Estimate:
    """The planner's Estimate of this run of ``world`` processes on ``profile`` (a host profile or a
    catalogue Cluster: step time, bubble, memory of every rank); ``data``: the run's (``planner_inputs``)."""
    from plait.plan.runs import predict_train

    model, layout, training = planner_inputs(cfg, world, data)
    return predict_train(model, profile, layout, training)


def host_speed(profile, device) -> float | None:
    """This host's speed now over its mean speed while ``profile`` was measured (the calibration's probe,
    ``plait.calibrate.kernels.reference_rate``), or None for a profile without it. The prediction follows
    the calibration's speed; a run on a host running slower or faster than then follows the host."""
    then = profile.host.get("speed_flops")
    if not then:
        return None
    from plait.calibrate.kernels import reference_rate

    return reference_rate(device) / float(then)


def check_dry_run(cfg: TrainConfig) -> None:
    """ConfigError for --dry-run with --cluster none (nothing to print), before any planning."""
    if cfg.dry_run and cfg.cluster == OFF:
        raise ConfigError("--dry-run: it prints the prediction, and --cluster none turns that off; give "
                          "--cluster FILE or leave it out (this host's cached profile)")


def dry_run(cfg: TrainConfig, world: int) -> dict:
    """What ``plait train --dry-run`` reports: the planner's prediction of this run of ``world`` processes
    on ``--cluster`` (default: this host's GPUs under the GPU model, or on a CPU host its cached profile; a
    dry run measures nothing), as the fields of a metrics row (``predicted_step_time_s``,
    ``predicted_bubble``, ``memory.predicted``, ``memory.notes``: what it assumes) and ``predicted_on``, what the
    prediction was made with."""
    from plait.calibrate import cache_path
    from plait.plan.host.profile import HostProfile

    check_dry_run(cfg)
    profile = HostProfile.load(cfg.cluster) if cfg.cluster is not None else gpu_cluster(world)
    if profile is None:
        path = cache_path()
        profile = cached_profile(path)
        if profile is None or world not in profile.sections:
            raise ConfigError(f"--dry-run: this host's cached profile ({path}) has no section of {world} "
                              f"processes; run `plait calibrate --processes {world}` or give --cluster FILE")
    if isinstance(profile, HostProfile):
        profile.section(world)
    est = predict(cfg, profile, world)
    return {"dry_run": True, "world": world, "predicted_step_time_s": est.step_time_s,
            "predicted_bubble": est.bubble_fraction, "memory": {"predicted": memory_rows(est),
                                                                "notes": memory_notes(est)},
            "predicted_on": source_of(est.cluster)}


def memory_notes(estimate: Estimate) -> list[str]:
    """What the predicted memory of ``estimate``'s run assumes where a step may differ from it: an MoE run's routing
    under expert parallelism (``plan.experts.prediction_note``), document masking's attention path
    (``plan.documents.note``)."""
    from plait.plan.documents import note as documents_note
    from plait.plan.experts import prediction_note

    notes = [prediction_note(estimate.model, estimate.layout)]
    if estimate.training.document_mask:
        notes.append(documents_note(estimate.model, estimate.layout, estimate.training.documents))
    return [n for n in notes if n is not None]


def memory_rows(estimate: Estimate) -> list[dict]:
    """Predicted bytes by kind on every pipeline rank (every TP/DP rank of a stage holds the same).
    ``activations_peak`` counts what autograd saves (as ``pm.memory_report()`` measures it); a layer
    recomputed under full recomputation briefly holds ``recompute_working`` more. ``grads`` is what is held
    after the step (as ``pm.memory_report()`` reports it), ``grads_at_peak`` what is held beside the
    activations at their peak (under ZeRO-2 the full buffer: see ``plan.memory.rank_memory``). Under ZeRO-3
    ``params_gathered_peak`` is the gathered working set (as ``pm.memory_report()`` measures it).
    ``weight_copies`` and ``loss_backward`` are held beside the activations at their peak without being saved
    for the backward (``plan.memory.step_transients``), and ``total`` is the step's predicted peak, all of these
    together (what the planner checks against the device's memory)."""
    from plait.plan.memory import zero3_working

    model, layout, precision = estimate.model, estimate.layout, estimate.training.precision
    gathered = {m.rank: zero3_working(model, layout, precision, m.rank) for m in estimate.rank_memory}
    return [{"pp_rank": m.rank, "params": m.weights, "grads": m.grads_held, "optimizer": m.optimizer,
             "activations_peak": m.activations - m.working, "recompute_working": m.working - gathered[m.rank],
             "grads_at_peak": m.grads, **({"params_gathered_peak": gathered[m.rank]} if gathered[m.rank] else {}),
             "weight_copies": m.weight_copies, "loss_backward": m.loss_backward, "total": m.total}
            for m in estimate.rank_memory]


class HostPredictor:
    """The planner's prediction of a run on this host's profile (``plait.train.observe.Predictor``)."""

    def predict(self, run: Run) -> Prediction | None:
        """Made on rank 0 and broadcast (the profile may be measured first, by every rank)."""
        import torch.distributed as dist

        from plait.distributed.collectives import collective

        world = run.ctx.world_size
        on_gpu = run.cfg.cluster is None and run.ctx.device.type == "cuda"  # the same on every rank
        profile: HostProfile | Cluster | None = None
        if not on_gpu:
            profile = host_profile(run.cfg, run.ctx)
        else:
            try:
                profile = gpu_cluster(world)
            except ConfigError:  # a GPU the catalogue lacks: the run goes on without a prediction
                pass
        box: list[Prediction | None] = [None]
        run.unpredicted = unpredicted(run.cfg, on_gpu)  # read only when nothing is predicted
        if run.ctx.rank == 0 and profile is not None:
            est = predict(run.cfg, profile, world, run.data)
            # the host's speed against its calibration's (the other ranks wait in the broadcast meanwhile)
            speed = None if on_gpu else host_speed(profile, run.ctx.device)
            box[0] = Prediction(est.step_time_s, est.bubble_fraction, dict(est.phases), memory_rows(est),
                                est.memory.total, source_of(est.cluster), speed, memory_notes(est))
        if run.ctx.world_size > 1:
            collective("broadcast of rank 0's prediction of the run", None,
                       lambda: dist.broadcast_object_list(box, src=0))
        return box[0]
