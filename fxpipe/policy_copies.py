"""The weight copies a consistency policy keeps (Plan(consistency)), counted from the actions."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from fxpipe.schedules import Action, ActionKind, Schedule, async_one_f_one_b, build

__all__ = ["stage_copies", "weight_copies"]


def weight_copies(policy: str, actions: Sequence[Action]) -> int:
    """The most copies of its weights a stage running `actions` (its own, STEPs included) keeps
    at once beside its parameters under consistency `policy` (runtime/consistency.py):
    none: 0; stash: one per weight version an in-flight micro-batch's forward used (a copy is
    made even of the current version); 2bw: those of the version before the latest step, and
    the shadow copy each step makes; predict: the predicted weights while a forward runs, for
    a micro-batch with a STEP between its forward and backward (an upper bound at the peak:
    they go when the forward ends)."""
    version, peak, made = 0, 0, 0
    copies: dict[int, tuple[int, set[int]]] = {}  # version -> (the copy's number, its users)
    shadow: int | None = None  # 2bw: the number of the copy each step makes of the old version
    forward_at: dict[int, int] = {}  # predict: micro-batch -> the version its forward ran at
    for a in actions:
        if a.kind is ActionKind.STEP:
            if policy == "2bw":
                made, shadow = made + 1, made + 1
            version += 1
        elif a.kind is ActionKind.F and policy == "predict":
            forward_at[a.mb] = version
        elif a.kind is ActionKind.F and policy in ("stash", "2bw"):
            used = max(version - 1, 0) if policy == "2bw" else version
            if used not in copies:  # 2bw takes the shadow where a step made one
                reuse = policy == "2bw" and shadow is not None and version > 0
                made += not reuse
                copies[used] = (shadow if reuse else made, set())
            copies[used][1].add(a.mb)
        elif a.kind is ActionKind.B and policy in ("stash", "2bw"):
            for used, (_, users) in list(copies.items()):
                users.discard(a.mb)
                if not users:  # its last micro-batch's backward: the copy goes
                    del copies[used]
        elif a.kind is ActionKind.B and policy == "predict" and version > forward_at.pop(
                a.mb, version):
            peak = 1  # a step landed between its forward and backward: Ŵ was made
        live = {number for number, _ in copies.values()} | ({shadow} - {None})
        peak = max(peak, len(live))
    return peak


def stage_copies(policy: str, schedule: str | Schedule, stages: int, p: int, s: int) -> int:
    """Weight-sized tensors stage s keeps beside its parameters, gradients and optimizer state
    under `schedule` (a name, built for the stages and p, or a user's Schedule) and consistency
    `policy`: its `weight_copies`, and under predict, where the stage steps inside the run (a
    STEP among its actions: async-1f1b), the copy of its last gradients it keeps from a step on
    for its prediction (runtime/consistency.py's last_grads; the other policies keep none)."""
    if isinstance(schedule, Schedule):
        mine = [a for actions in schedule.actions for a in actions if a.stage == s]
        steps = any(a.kind is ActionKind.STEP for a in mine)
        return weight_copies(policy, mine) + (policy == "predict" and steps)
    return _named_copies(policy, schedule, stages, p, s)


@functools.lru_cache(maxsize=256)  # the planners ask for every stage at every count
def _named_copies(policy: str, name: str, stages: int, p: int, s: int) -> int:
    try:  # async-1f1b as step_many streams it, long enough to reach its steady state
        built = (async_one_f_one_b(stages, p, 2 * stages + 2) if name == "async-1f1b"
                 else build(name, stages, p))
    except ValueError:  # not built here (a count it cannot run, or several stages a device)
        # no copies without a policy or a step inside the run; else one per micro-batch at most
        return 0 if policy == "none" or name != "async-1f1b" else p
    return stage_copies(policy, built, stages, p, s)
