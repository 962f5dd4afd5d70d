"""The Action IR: one compute step of a pipeline schedule, with PyTorch's compact ``2F0`` string form."""

from __future__ import annotations

import re
from typing import NamedTuple

from plait.errors import ConfigError

#: F forward, B full backward, I input-gradient half of a split backward, W weight-gradient half.
KINDS = ("F", "B", "I", "W")
KIND_NAMES = {"F": "forward", "B": "backward", "I": "input-grad", "W": "weight-grad"}

_ACTION_RE = re.compile(r"^\s*(\d+)([FBIW])(\d+)\s*$")


class Action(NamedTuple):
    """One compute step: ``kind`` of micro-batch ``microbatch`` through global chunk ``stage``.

    ``stage`` is the global chunk index in ``[0, stages * virtual)``; the rank that runs it is given by
    the schedule's placement (``Schedule.stage_to_rank``). ``str(action)`` is PyTorch pipelining's
    compact form ``f"{stage}{kind}{microbatch}"`` (e.g. ``2F0``, ``1I3``); ``Action.parse`` reverses it.
    """

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"2F0"`` into ``Action("F", 2, 0)``; raises ConfigError on anything else."""
        match = _ACTION_RE.match(text)
        if match is None:
            raise ConfigError(
                f"action {text!r}: expected <stage><kind><microbatch> with kind one of "
                f"{'/'.join(KINDS)}, e.g. '2F0' or '1I3'"
            )
        stage, kind, mb = match.groups()
        return cls(kind, int(stage), int(mb))


def format_actions(actions: list[Action]) -> str:
    """Space-separated compact form of a rank's action list."""
    return " ".join(map(str, actions))


def parse_actions(text: str) -> list[Action]:
    """Parse a space- or comma-separated list of compact actions (empty cells are skipped)."""
    return [Action.parse(tok) for tok in re.split(r"[\s,]+", text.strip()) if tok]
