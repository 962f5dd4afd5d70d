"""``plait train --layout auto``: ask the planner for the fastest layout that fits the processes at hand.

The planner (plait.plan) searches only what the runtime runs, so its best layout converts to a
ParallelConfig (``Layout.to_parallel_config``). The cluster is this host: the profile ``--cluster FILE``
names, else this host's cached calibration (``plait calibrate``, or the one ``plait train`` measures on first
use) when it has a section for that many processes, else the planner's ``cpu`` catalogue entry (a generic CPU
running Gloo) with this host's memory shared evenly by the processes. The chosen line says which.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from plait.errors import ConfigError
from plait.train.config import TrainConfig, model_config, validate
from plait.words import counted


def plan_model(cfg: TrainConfig):
    """The planner's description (``plan.Model``) of the model ``cfg`` trains, at ``cfg.seq_len`` tokens: what the
    config plait train builds it from says (``Model.from_llama_config``: its shapes and the features the planner
    counts, Qwen3's per-head q/k norms, Mistral's window), as ``plait plan --model`` reads a folder."""
    from plait.plan import Model

    return Model.from_llama_config(model_config(cfg).to_dict(), cfg.seq_len, name=Path(cfg.model).name)


def host_cluster(processes: int):
    """This host as the planner sees it: ``processes`` CPU 'devices' sharing its memory evenly."""
    from plait.plan import Cluster, get_gpu

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = replace(get_gpu("cpu"), memory=total / processes)
    return Cluster(cpu, processes, gpus_per_node=processes)


def planning_cluster(cfg: TrainConfig, processes: int):
    """(the Cluster ``--layout auto`` plans on, what it is): see the module's docstring."""
    from plait.cli.predict import OFF, cached_profile
    from plait.plan import Cluster

    if cfg.cluster not in (None, OFF):
        return Cluster.from_profile(cfg.cluster, processes), f"the profile {cfg.cluster}"
    if cfg.cluster is None:
        from plait.calibrate import cache_path

        cached = cached_profile(cache_path())
        if cached is not None and processes in cached.sections:
            return Cluster.from_profile(cached, processes), "this host's calibration"
    return host_cluster(processes), "the catalogue's generic cpu (this host is not calibrated: plait calibrate)"


def auto_layout(cfg: TrainConfig, world: int) -> tuple[TrainConfig, str]:
    """``cfg`` with the layout of the fastest planned layout for ``world`` processes that fits and that
    ``validate`` accepts, and one line saying what was chosen (with --document-mask, planned with its memory and as
    the documents of --data cut the rows: ``plait.cli.predict.row_lengths``). ConfigError if none does."""
    from plait.cli.predict import row_lengths
    from plait.plan import Training, search
    from plait.plan.eager import RUNTIME_ELEMENTWISE
    from plait.plan.explain import memory_unit
    from plait.plan.optimizers import RUNTIME_MASTERS

    cluster, source = planning_cluster(cfg, world)
    model = plan_model(cfg)
    training = Training(cfg.batch_size, precision=cfg.parallel.precision, elementwise=RUNTIME_ELEMENTWISE,
                        masters=RUNTIME_MASTERS, document_mask=cfg.document_mask,
                        documents=row_lengths(cfg) if cfg.document_mask else None)
    result = search(model, cluster, training, top=20)
    reasons = []
    for est in result.best:
        parallel = est.layout.to_parallel_config(training)  # at the training's precision: cfg.parallel.precision
        candidate = replace(cfg, parallel=parallel, layout="flags", nproc=world)
        try:
            validate(candidate, world)
        except ConfigError as exc:
            reasons.append(f"{est.layout.short()}: {exc}")
            continue
        unit, scale = memory_unit([est])
        line = (f"--layout auto: {est.layout.short()} (the planner's fastest of "
                f"{counted(result.considered, 'layout')} on {counted(world, 'process')} on {source}: "
                f"{est.step_time_s:.3g} s/step, {est.memory.total / scale:,.1f} of {est.memory.usable / scale:,.1f} "
                f"{unit} per process predicted)")
        return candidate, line
    why = "; ".join(reasons[:3]) or f"nothing fits ({dict(result.rejected)})"
    raise ConfigError(f"--layout auto: no planned layout for {counted(world, 'process')} runs here: {why}")
