"""Pipeline schedules as plain data: action lists, their generators, and their lowering."""

from fxpipe.schedules.actions import (
    Action,
    ActionKind,
    B,
    DeadlockError,
    F,
    Schedule,
    ScheduleError,
    W,
)
from fxpipe.schedules.csv_form import load_csv, save_csv
from fxpipe.schedules.generators import (
    SCHEDULES,
    async_one_f_one_b,
    build,
    forwards_first,
    gpipe,
    one_f_one_b,
    peak_activations,
)
from fxpipe.schedules.lowering import add_communication, add_step, chain, check_communication, lower

__all__ = [
    "SCHEDULES", "Action", "ActionKind", "B", "DeadlockError", "F", "Schedule", "ScheduleError",
    "W", "add_communication", "add_step", "async_one_f_one_b", "build", "chain",
    "check_communication", "forwards_first", "gpipe", "load_csv", "lower", "one_f_one_b",
    "peak_activations", "save_csv",
]
