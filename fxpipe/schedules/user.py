"""A user's own schedule: checked to train every micro-batch once and never hang, then lowered."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable

from fxpipe.schedules.actions import Action, ActionKind, B, F, Schedule, ScheduleError, W
from fxpipe.schedules.csv_form import load_csv
from fxpipe.schedules.lowering import add_communication, chain, check_communication

__all__ = ["check_user_schedule", "lower_user_schedule", "read_user_schedule"]

K = ActionKind


def read_user_schedule(schedule: Schedule | str | os.PathLike) -> Schedule:
    """`schedule` itself, or the one in a PyTorch pipelining CSV file it names."""
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, (str, os.PathLike)):
        path = pathlib.Path(schedule)
        if not path.is_file():
            raise ScheduleError(f"there is no schedule file {str(path)!r}; give the path of a "
                                "CSV written by fxpipe.schedules.save_csv or PyTorch's _dump_csv")
        return load_csv(path)
    raise ScheduleError(f"a schedule is a name, a fxpipe.schedules.Schedule or a .csv path, "
                        f"not {type(schedule).__name__}")


def check_user_schedule(schedule: Schedule) -> None:
    """Raise ScheduleError (DeadlockError when it would hang) unless `schedule` trains one
    mini-batch: every stage runs F and B of every micro-batch once, F first, in one micro-batch
    order across stages, with sends and receives (its own, or a chain's) that cannot hang."""
    if schedule.minibatches != 1 or any(a.kind is K.STEP for st in schedule.actions for a in st):
        raise ScheduleError(
            f"schedule {schedule.name!r} steps the optimizer inside the run (STEP actions, or "
            "several mini-batches): fxpipe runs only its own asynchronous schedule, "
            "schedule='async-1f1b'; give a flushed schedule of one mini-batch without STEP")
    for s, stage in enumerate(schedule.actions):
        _check_stage(schedule, s, stage)
    if schedule.lowered:
        check_communication(schedule)
        return
    _check_same_order(schedule)
    check_communication(add_communication(schedule, chain(schedule.stages)))


def _check_stage(schedule: Schedule, s: int, stage: tuple[Action, ...]) -> None:
    where = {a: i for i, a in enumerate(stage)}
    p = schedule.micro_batches
    for kind in (F, B):
        missing = [m for m in range(p) if Action(s, kind, m) not in where]
        if missing:
            names = " ".join(str(Action(s, kind, m)) for m in missing)
            raise ScheduleError(
                f"stage {s} of schedule {schedule.name!r} never runs {names}: every stage runs "
                f"F and B of each of its {p} micro-batches exactly once; add them (or give "
                "fewer micro-batches)")
    for m in range(p):
        if where[Action(s, B, m)] < where[Action(s, F, m)]:
            raise ScheduleError(f"{Action(s, B, m)} comes before {Action(s, F, m)} on stage {s} "
                                f"of schedule {schedule.name!r}: a backward needs its forward; "
                                f"move {Action(s, B, m)} after {Action(s, F, m)}")
        weight = where.get(Action(s, W, m))  # the weight-gradient half of a split backward
        if weight is not None and weight < where[Action(s, B, m)]:
            raise ScheduleError(f"{Action(s, W, m)} comes before {Action(s, B, m)} on stage {s} "
                                f"of schedule {schedule.name!r}: the weight gradient follows "
                                f"the input gradient; move {Action(s, W, m)} after "
                                f"{Action(s, B, m)}")
    reduces = [i for i, a in enumerate(stage) if a.kind is K.ALLREDUCE]
    last = max(i for i, a in enumerate(stage) if a.kind.is_compute)
    if len(reduces) > 1 or (reduces and reduces[0] < last):
        raise ScheduleError(
            f"stage {s} of schedule {schedule.name!r} all-reduces its gradients (ALLREDUCE, "
            "PyTorch's REDUCE_GRAD) before its last backward or more than once; keep one, after "
            "the stage's last compute action")


def _check_same_order(schedule: Schedule) -> None:
    """Messages between two stages arrive in the order they were sent, so neighbours must run
    the forwards (and the backwards) in one micro-batch order; said here in compute terms."""
    for kind in (F, B):
        orders = [[a.mb for a in stage if a.kind is kind] for stage in schedule.actions]
        for s in range(1, schedule.stages):
            if orders[s] != orders[s - 1]:
                step = next(i for i, (x, y) in enumerate(zip(orders[s - 1], orders[s])) if x != y)
                raise ScheduleError(
                    f"stage {s - 1} of schedule {schedule.name!r} runs its {kind.name}s in "
                    f"micro-batch order {orders[s - 1]}, stage {s} in {orders[s]}: messages "
                    f"between stages arrive in the order they were sent, so stage {s}'s "
                    f"{kind.name} number {step} ({Action(s, kind, orders[s][step])}) would "
                    f"receive micro-batch {orders[s - 1][step]}'s; run every stage's "
                    f"{kind.name}s in one micro-batch order")


def lower_user_schedule(schedule: Schedule, edges: Iterable[tuple[int, int]]) -> Schedule:
    """A checked user schedule with the sends and receives of the stage `edges` (the model's,
    skip edges included), proved not to hang; a lowered one must send along exactly them."""
    edges = sorted(set(edges))
    if schedule.lowered:
        sent = sorted({(a.stage, a.peer) for st in schedule.actions for a in st
                       if a.kind is K.SEND_F})
        if sent != edges:
            raise ScheduleError(
                f"schedule {schedule.name!r} sends activations along stage pairs {sent}, but "
                f"the model's stages exchange values along {edges}; give the compute-only "
                "schedule (F and B actions) and fxpipe adds the sends and receives itself")
        lowered = schedule
    else:
        lowered = add_communication(schedule, edges)
    check_communication(lowered)
    return lowered
