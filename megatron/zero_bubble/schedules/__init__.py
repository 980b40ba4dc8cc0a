"""Planning layer: schedules as plain data, their costs, simulation, validation and planners.

Pure Python: importable without torch or megatron-core.
"""
from .costs import Costs
from .ops import Op
from .problem import MemoryLimit
from .schedule import LAYOUTS, OPS, Pass, Schedule, ScheduleError
from .simulate import Timeline, simulate
from .validate import validate

__all__ = ["Costs", "LAYOUTS", "MemoryLimit", "OPS", "Op", "Pass", "Schedule", "ScheduleError", "Timeline",
           "simulate", "validate"]
