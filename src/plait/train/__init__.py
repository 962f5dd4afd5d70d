"""Training: config, byte-level data, the loop, sharded atomic checkpoints, elastic launch (``plait train``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.train.config import PRESETS, TrainConfig, validate

if TYPE_CHECKING:
    from plait.train.observe import Predictor

__all__ = ["PRESETS", "TrainConfig", "train", "train_job", "validate"]


def train(cfg: TrainConfig, ctx=None, reporter=None, stop=None, predictor: Predictor | None = None):
    """Run the training loop on this rank (every rank calls it); returns a ``TrainResult``."""
    from plait.train.loop import train as _train

    return _train(cfg, ctx, reporter, stop, predictor)


def train_job(payload: dict, predictor: Predictor | None = None) -> dict:
    """Worker entry of a training run: catch SIGTERM and SIGINT (stop at the next step with a checkpoint),
    validate against the real world size, train, report on rank 0. ``predictor``: see ``plait.train.observe``."""
    import os
    from dataclasses import asdict

    from plait.errors import ConfigError
    from plait.train.preempt import StopRequest
    from plait.train.report import Reporter

    stop = StopRequest()  # catches SIGTERM and SIGINT from the first step on (plait.train.loop.train)
    cfg = TrainConfig.from_dict(payload)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if cfg.layout == "auto":
        raise ConfigError("--layout auto: the planner chooses the layout in plait train's command (its worker is "
                          "plait.cli.train_worker:train_worker); a run started here takes the layout flags")
    validate(cfg, world=world)
    reporter = Reporter(cfg, rank)
    return asdict(train(cfg, reporter=reporter, stop=stop, predictor=predictor))
