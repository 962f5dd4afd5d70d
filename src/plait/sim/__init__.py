"""Pipeline schedule simulator: timing, bubble and activation-memory accounting, Gantt/PNG/trace output."""

from plait.sim.costs import Costs
from plait.sim.engine import SimResult, simulate

__all__ = ["Costs", "SimResult", "simulate"]
