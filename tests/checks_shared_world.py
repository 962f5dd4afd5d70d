"""Rank side of tests/test_shared_world.py: a group whose checks end, and one whose second check outlasts its
group's bound on one rank while the other waits for it in a collective."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from harness import run_checks


def rank_main(mode: str) -> dict:
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def total() -> float:
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        return x.item()

    def stuck() -> None:
        if rank == 1:
            time.sleep(60)  # the group's bound is far shorter
        dist.barrier()

    checks = [("sum", total)] + ([("stuck", stuck), ("after", total)] if mode == "stuck" else [])
    return {**run_checks(checks), "mode": mode}
