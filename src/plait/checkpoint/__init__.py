"""Checkpoint I/O shared by training, generation and serving: sharded, layout-independent checkpoints
(``store``: reading; ``writer``: saving, also in the background) and where each local tensor of a
ParallelModel sits in the full one (``shards``)."""

from __future__ import annotations

from plait.checkpoint.shards import LocalTensor, init_local, load_local, local_tensors
from plait.checkpoint.store import (
    CheckpointReader,
    export_pretrained,
    find_checkpoint,
    incomplete_checkpoints,
    load_checkpoint,
    model_config,
    save_checkpoint,
)
from plait.checkpoint.writer import AsyncCheckpointer

__all__ = ["AsyncCheckpointer", "CheckpointReader", "LocalTensor", "export_pretrained", "find_checkpoint",
           "incomplete_checkpoints", "init_local", "load_checkpoint", "load_local", "local_tensors", "model_config",
           "save_checkpoint"]
