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
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if cfg.layout == "auto":  # under torchrun: every worker asks the planner (same answer everywhere)
        from plait.train.auto import auto_layout

        cfg, line = auto_layout(cfg, world)
        if rank == 0:
            print(line, flush=True)
    validate(cfg, world=world)
    reporter = Reporter(cfg, rank)
    return asdict(train(cfg, reporter=reporter, stop=stop))
