"""What a run shows beside its measurements: a ``Prediction`` from a ``Predictor`` its caller installs.

The loop measures (step time, the step by phase, bubble, bytes per rank) and knows nothing of how a
prediction is made: ``plait train``'s command installs the planner's predictor (``plait.cli.predict``);
a run without one shows its measurements alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from plait.train.loop import Run

#: The phases of a step the loop times on every rank (``train_one``), in the order they happen.
PHASES = ("forward_backward", "grad_reduction", "optimizer")


@dataclass
class Prediction:
    """Figures predicted for a run, shown beside the measured ones (the same on every rank)."""

    step_time_s: float
    bubble: float  # idle share of the step
    phases: dict[str, float] = field(default_factory=dict)  # the step by phase (keys: ``PHASES``)
    memory: list[dict] = field(default_factory=list)  # bytes by kind per pipeline rank ("pp_rank", "params", ...)
    peak_bytes: float = 0.0  # the most loaded rank's total
    source: str = ""  # what predicted it, e.g. "cpu-host (plait plan, host profile)"
    host_speed: float | None = None  # the host's speed at the start over its speed when the prediction's
    # figures were measured (None: not known)
    notes: list[str] = field(default_factory=list)  # what the memory figures assume, said under their table

    def row(self) -> dict:
        """The fields a step's metrics row carries (``predicted_step_time_s``, ...)."""
        return {"predicted_step_time_s": self.step_time_s, "predicted_bubble": self.bubble,
                "predicted_phase_s": self.phases}


#: the --cluster that turns the prediction off
NO_CLUSTER = "none"
#: a metrics row's predicted fields when nothing was predicted
NO_PREDICTION = {"predicted_step_time_s": None, "predicted_bubble": None, "predicted_phase_s": None}


class Predictor(Protocol):
    """Makes a run's prediction once its model and layout are built."""

    def predict(self, run: Run) -> Prediction | None:
        """Called on every rank after ``build`` and before the first step; may be collective over the run's
        world (e.g. to measure the host) and returns the same on every rank (None: nothing predicted)."""
        ...
