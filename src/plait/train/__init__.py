"""Training: config, byte-level data, the loop, sharded atomic checkpoints, elastic launch (``plait train``)."""

from __future__ import annotations

from plait.train.config import PRESETS, TrainConfig, validate

__all__ = ["PRESETS", "TrainConfig", "train", "train_job", "validate"]


def train(cfg: TrainConfig, ctx=None, reporter=None, stop=None):
    """Run the training loop on this rank (every rank calls it); returns a ``TrainResult``."""
    from plait.train.loop import train as _train

    return _train(cfg, ctx, reporter, stop)


def train_job(payload: dict) -> dict:
    """Worker entry of ``plait train``: catch SIGTERM (stop at the next step with a checkpoint), validate against
    the real world size, train, report on rank 0."""
    import os
    from dataclasses import asdict

    from plait.train.preempt import StopRequest
    from plait.train.report import Reporter

    stop = StopRequest().install()
    cfg = TrainConfig.from_dict(payload)
    validate(cfg, world=int(os.environ.get("WORLD_SIZE", "1")))
    reporter = Reporter(cfg, int(os.environ.get("RANK", "0")))
    return asdict(train(cfg, reporter=reporter, stop=stop))
