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
    device_peak_activations,
    forwards_first,
    gpipe,
    one_f_one_b,
    peak_activations,
)
from fxpipe.schedules.interleaved import (
    VIRTUAL_SCHEDULES,
    dualpipev,
    interleaved_one_f_one_b,
    looped_bfs,
    round_robin,
    v_shape,
    zbv,
)
from fxpipe.schedules.lowering import (
    add_communication,
    add_step,
    chain,
    check_communication,
    delivered_sends,
    gradients_let_go,
    lower,
)
from fxpipe.schedules.zero_bubble import zb_h1

__all__ = [
    "SCHEDULES", "VIRTUAL_SCHEDULES", "Action", "ActionKind", "B", "DeadlockError", "F",
    "Schedule", "ScheduleError", "W", "add_communication", "add_step", "async_one_f_one_b",
    "build", "chain", "check_communication", "delivered_sends", "device_peak_activations",
    "dualpipev",
    "forwards_first", "gpipe", "gradients_let_go",
    "interleaved_one_f_one_b", "load_csv", "looped_bfs", "lower", "one_f_one_b", "peak_activations",
    "round_robin", "save_csv", "v_shape", "zb_h1", "zbv",
]
