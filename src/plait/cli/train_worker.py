"""The worker of ``plait train`` (one per process, launched here or by torchrun): the layout the planner
chose when ``--layout auto``, the ``--cluster`` profile checked, then the run with the planner's predictor."""

from __future__ import annotations

import os

#: what the fork server imports for the workers besides torch and this module (plait.distributed.launch): the
#: training loop's modules, and torch._dynamo, which every torch optimizer imports when it is made (~2 s)
PRELOAD = ("torch._dynamo", "plait.train.loop", "plait.cli.predict", "plait.cli.auto_layout")


def train_worker(payload: dict) -> dict:
    """``plait.train.train_job`` with the planner installed: under torchrun every worker asks the planner
    for ``--layout auto`` (the same answer everywhere) and rank 0 says what it chose."""
    from plait.cli.auto_layout import auto_layout
    from plait.cli.predict import HostPredictor, check_cluster
    from plait.train import TrainConfig, train_job

    cfg = TrainConfig.from_dict(payload)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.layout == "auto":
        cfg, line = auto_layout(cfg, world)
        if int(os.environ.get("RANK", "0")) == 0:
            print(line, flush=True)
    check_cluster(cfg, world)
    return train_job(cfg.to_dict(), predictor=HostPredictor())
