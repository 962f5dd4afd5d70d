"""Experiment logs beside ``--metrics``: TensorBoard (``--tensorboard DIR``) and Weights & Biases (``--wandb
PROJECT``), each an optional extra; rank 0 logs every step's numbers under the same names as the metrics rows."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from plait.errors import require_extra

if TYPE_CHECKING:
    from plait.parallel_model import ParallelModel

# the numbers of a metrics row logged each step (when present and not None)
SCALARS = ("loss", "held_out_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "predicted_step_time_s",
           "measured_bubble", "predicted_bubble", "epoch", "tokens_seen", "aux_loss", "expert_imbalance",
           "dropped_fraction")


def experts_row(pm: ParallelModel) -> dict:
    """A metrics row's routing numbers of the last step (``plait.experts.load.ExpertLoad.row``; a dense model:
    none)."""
    load = pm.last_expert_load
    return load.row() if load is not None else {}


def check_extras(tensorboard: str | None, wandb: str | None) -> None:
    """MissingExtraError (a ConfigError) naming the extra to install, before anything is launched."""
    if tensorboard:
        require_extra("tensorboard", ("tensorboard",), "--tensorboard")
    if wandb:
        require_extra("wandb", ("wandb",), "--wandb")


def scalars(row: dict) -> dict[str, float]:
    """``train/<name>`` of the row's numbers, and ``memory/rank<r>_MiB`` of the measured memory when the row has it."""
    out = {f"train/{k}": float(row[k]) for k in SCALARS if isinstance(row.get(k), (int, float))}
    for r in (row.get("memory") or {}).get("measured", []):
        kinds = ("params", "grads", "optimizer", "activations_peak")
        out[f"memory/rank{r['rank']}_MiB"] = sum(r.get(k) or 0 for k in kinds) / 2**20
    return out


class ExperimentLogs:
    """The writers asked for; ``log(row)`` each step, ``close()`` at the end."""

    def __init__(self, tensorboard: str | None, wandb: str | None, config: dict, resumed_at: int = 0):
        check_extras(tensorboard, wandb)
        self.tb: Any = None
        self.run: Any = None
        self.note = ""
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=tensorboard, purge_step=resumed_at + 1 if resumed_at else None)
        if wandb:
            import wandb as wb

            mode: Any = os.environ.get("WANDB_MODE", "offline")  # no network needed unless asked for
            self.run = wb.init(project=wandb, config=config, mode=mode, resume="allow")
            if mode == "offline":
                self.note = (f"wandb: logged offline in {self.run.dir}; `wandb sync` uploads it "
                             "(WANDB_MODE=online logs live)")

    def log(self, row: dict) -> None:
        values, step = scalars(row), int(row["step"])
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.run is not None:
            self.run.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.run is not None:
            self.run.finish()
