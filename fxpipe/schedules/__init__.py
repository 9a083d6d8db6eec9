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
from fxpipe.schedules.zero_bubble import zb_h1

__all__ = [
    "SCHEDULES", "Action", "ActionKind", "B", "DeadlockError", "F", "Schedule", "ScheduleError",
    "W", "add_communication", "add_step", "async_one_f_one_b", "build", "chain",
    "check_communication", "forwards_first", "gpipe", "lower", "one_f_one_b", "peak_activations",
    "zb_h1",
]
