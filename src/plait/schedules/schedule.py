"""The ``Schedule`` object: per-rank ordered action lists plus the chunk-to-rank placement."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plait.errors import ConfigError
from plait.schedules.actions import Action


def loop_placement(ranks: int, virtual: int) -> tuple[int, ...]:
    """Round-robin ("looped") placement: chunk ``c`` lives on rank ``c % ranks``."""
    return tuple(c % ranks for c in range(ranks * virtual))


def v_placement(ranks: int) -> tuple[int, ...]:
    """V-shaped placement of 2 chunks per rank: chunk ``c`` on rank ``c`` if ``c < P`` else ``2P-1-c``."""
    return tuple(c if c < ranks else 2 * ranks - 1 - c for c in range(2 * ranks))


@dataclass
class Schedule:
    """A pipeline schedule as data: ``actions[rank]`` is the ordered list of compute steps of that rank.

    ``num_stages`` counts chunks (``num_ranks * virtual``); ``placement[c]`` is the rank holding chunk
    ``c``. The simulator and the pipeline runtime both consume this object unchanged.
    """

    name: str
    num_ranks: int
    virtual: int
    microbatches: int
    placement: tuple[int, ...]
    actions: list[list[Action]]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        """Number of chunks (global pipeline stages), ``num_ranks * virtual``."""
        return len(self.placement)

    @property
    def num_actions(self) -> int:
        return sum(len(a) for a in self.actions)

    def stage_to_rank(self, chunk: int) -> int:
        """The rank that holds global chunk ``chunk``."""
        if not 0 <= chunk < self.num_stages:
            raise ConfigError(f"chunk={chunk}: must be in [0, {self.num_stages})")
        return self.placement[chunk]

    def stages_of_rank(self, rank: int) -> list[int]:
        """The chunks held by ``rank``, in increasing order."""
        if not 0 <= rank < self.num_ranks:
            raise ConfigError(f"rank={rank}: must be in [0, {self.num_ranks})")
        return [c for c, r in enumerate(self.placement) if r == rank]

    def validate(self) -> Schedule:
        """Check structure and dependencies and dry-run the schedule; raise ConfigError if it is broken.

        Returns ``self`` so that ``build(...).validate()`` chains.
        """
        from plait.schedules.validate import validate

        validate(self)
        return self

    def grid(self, marks: dict[int, int] | None = None, window: int | None = None) -> str:
        """The per-rank action grid (``marks``: rank -> index of the action to show as ``[..]``)."""
        from plait.schedules.validate import format_grid

        return format_grid(self, marks or {}, window)

    def __str__(self) -> str:
        head = (
            f"{self.name}: {self.num_ranks} ranks, {self.num_stages} chunks "
            f"(virtual={self.virtual}), {self.microbatches} micro-batches"
        )
        return head + "\n" + self.grid()

    # ---- JSON ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_ranks": self.num_ranks,
            "num_stages": self.num_stages,
            "virtual": self.virtual,
            "microbatches": self.microbatches,
            "placement": list(self.placement),
            "actions": [[str(a) for a in row] for row in self.actions],
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        try:
            placement = tuple(int(r) for r in data["placement"])
            sched = cls(
                name=str(data.get("name", "custom")),
                num_ranks=int(data["num_ranks"]),
                virtual=int(data["virtual"]),
                microbatches=int(data["microbatches"]),
                placement=placement,
                actions=[[Action.parse(s) for s in row] for row in data["actions"]],
                meta=dict(data.get("meta", {})),
            )
        except KeyError as exc:
            raise ConfigError(f"schedule JSON: missing field {exc.args[0]!r}") from None
        if "num_stages" in data and int(data["num_stages"]) != sched.num_stages:
            raise ConfigError(
                f"schedule JSON: num_stages={data['num_stages']} but placement has {sched.num_stages} chunks"
            )
        return sched

    def to_json(self, path: str | Path | None = None, indent: int | None = None) -> str:
        """JSON text of the schedule (actions in compact form); also written to ``path`` if given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Schedule:
        """Load from JSON text or from a path to a JSON file."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        return cls.from_dict(json.loads(text))

    # ---- PyTorch pipelining CSV --------------------------------------------------------------------
    def to_csv(self, path: str | Path | None = None) -> str:
        """PyTorch's compute-only CSV (one row per rank, cells like ``0F0``); written to ``path`` if given."""
        from plait.schedules.io import to_csv

        return to_csv(self, path)

    @classmethod
    def from_csv(cls, text_or_path: str | Path, name: str = "csv") -> Schedule:
        """Read PyTorch's compute-only CSV (a path, or the CSV text itself)."""
        from plait.schedules.io import from_csv

        return from_csv(text_or_path, name=name)
