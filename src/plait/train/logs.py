"""Experiment logs: the ``--metrics`` file as a resumed run continues it, TensorBoard (``--tensorboard DIR``) and
Weights & Biases (``--wandb PROJECT``), each an optional extra; rank 0 logs every step's numbers under the same names
as the metrics rows. A resumed run continues the W&B run of the run it resumes (``WANDB_RECORD`` in the checkpoint
folder keeps its id and the last step logged to it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from plait.errors import require_extra

if TYPE_CHECKING:
    from plait.parallel_model import ParallelModel

# the numbers of a metrics row logged each step (when present and not None)
SCALARS = ("loss", "held_out_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "predicted_step_time_s",
           "measured_bubble", "predicted_bubble", "epoch", "tokens_seen", "aux_loss", "expert_imbalance",
           "dropped_fraction")

# in --checkpoint-dir: the W&B run this folder's run logs to ({"project", "id", "step": the last step logged})
WANDB_RECORD = "wandb-run.json"


def experts_row(pm: ParallelModel) -> dict:
    """A metrics row's routing numbers of the last step (``plait.experts.load.ExpertLoad.row``; a dense model:
    none)."""
    load = pm.last_expert_load
    return load.row() if load is not None else {}


def open_metrics(path: str | Path, resumed_at: int | None) -> TextIO:
    """``--metrics`` opened for a run's rows: emptied for a fresh run (``resumed_at`` None), else for appending by a
    run resumed at step ``resumed_at``. The rows of later steps (the run that stopped after that checkpoint wrote
    them, and this run trains those steps again) and a line cut short (a kill while it was written) are dropped
    first, so the file holds each step once; rows of other kinds (a ``--dry-run``'s prediction) stay. The file is
    then replaced whole (written beside it, then renamed)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if resumed_at is None:
        return open(p, "w")
    lines = p.read_text().splitlines() if p.is_file() else []
    kept = [line for line in lines if _kept(line, resumed_at)]
    if kept != lines:
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, p)
    return open(p, "a")


def _kept(line: str, resumed_at: int) -> bool:
    """Whether a resumed run keeps this line of its --metrics file (``open_metrics``)."""
    try:
        row = json.loads(line)
    except ValueError:
        return False
    step = row.get("step") if isinstance(row, dict) else None
    return not isinstance(step, int) or step <= resumed_at


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
    """The writers asked for; ``log(row)`` each step, ``close()`` at the end. With ``run_folder`` (the checkpoint
    folder) the W&B run's id and last logged step are kept there, and a ``continued`` run (--resume,
    --auto-resume) logs to the W&B run recorded there for the same project, from the step after the last one it
    holds: the steps a restart trains again keep the values first logged, each step once. Otherwise (a fresh
    start, another project, no record) a new W&B run."""

    def __init__(self, tensorboard: str | None, wandb: str | None, config: dict, resumed_at: int = 0,
                 run_folder: str | Path | None = None, continued: bool = False):
        check_extras(tensorboard, wandb)
        self.tb: Any = None
        self.run: Any = None
        self.note = ""
        self.record = Path(run_folder) / WANDB_RECORD if run_folder is not None else None
        self.logged = 0  # the last step the W&B run holds
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard drops what the folder holds from step resumed_at + 1 on (all of it for a fresh start), so
            # the steps a restart trains again, or an earlier run's in this folder, do not show twice
            self.tb = SummaryWriter(log_dir=tensorboard, purge_step=resumed_at + 1)
        if wandb:
            import wandb as wb

            earlier = read_wandb_record(self.record, wandb) if continued else None
            mode: Any = os.environ.get("WANDB_MODE", "offline")  # no network needed unless asked for
            if earlier is None:
                self.run = wb.init(project=wandb, config=config, mode=mode)
            else:
                self.run = wb.init(project=wandb, config=config, mode=mode, id=earlier[0], resume="allow")
                self.logged = earlier[1]
            self._keep_record()
            if earlier is not None:
                self.note = (f"wandb: continued run {self.run.id} of project {wandb}"
                             + (f" after its step {self.logged}" if self.logged else ""))
            if mode == "offline":
                self.note += ("; " if self.note else "wandb: ") + (
                    f"logged offline in {self.run.dir}; `wandb sync` uploads it (WANDB_MODE=online logs live)")

    def log(self, row: dict) -> None:
        values, step = scalars(row), int(row["step"])
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        if self.run is not None and step > self.logged:
            self.run.log(values, step=step)
            self.logged = step
            self._keep_record()

    def _keep_record(self) -> None:
        """The W&B run's project, id and last logged step in ``WANDB_RECORD`` (replaced whole)."""
        if self.record is None:
            return
        self.record.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.record.with_name(f".{self.record.name}.tmp")
        tmp.write_text(json.dumps({"project": self.run.project, "id": self.run.id, "step": self.logged}) + "\n")
        os.replace(tmp, self.record)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.run is not None:
            self.run.finish()


def read_wandb_record(record: Path | None, project: str) -> tuple[str, int] | None:
    """The id and last logged step of the W&B run ``record`` keeps, when it is one of ``project`` (None when
    there is no record, it is of another project, or it cannot be read)."""
    try:
        kept = json.loads(record.read_text()) if record is not None else None
        if kept is not None and kept.get("project") == project and isinstance(kept.get("id"), str):
            return kept["id"], int(kept.get("step") or 0)
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return None
