"""Pipeline schedules as data: the Action IR, generators, validation and CSV/JSON io (no torch)."""

from plait.schedules.actions import KINDS, Action, format_actions, parse_actions
from plait.schedules.build import SCHEDULE_NAMES, build_schedule
from plait.schedules.schedule import Schedule, loop_placement, v_placement

__all__ = [
    "KINDS",
    "SCHEDULE_NAMES",
    "Action",
    "Schedule",
    "build_schedule",
    "format_actions",
    "loop_placement",
    "parse_actions",
    "v_placement",
]
