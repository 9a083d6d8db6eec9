"""Plan(recompute=...): which stages recompute their forward during backward, checked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fxpipe.errors import PlanError

__all__ = ["cannot_recompute", "recompute_spec", "stage_recompute"]


def recompute_spec(plan: Any) -> bool | str | tuple[bool, ...]:
    """The plan's `recompute`, checked against its stages and schedule: False (no stage),
    True (every stage), "auto" (the partitioner turns it on only for the stages that need it
    to fit Plan(memory_limit=...); with no cap every stage fits, so none recomputes), or one
    bool per stage. A schedule no stage can recompute on (cannot_recompute) is refused for
    True and lists, and makes "auto" recompute nothing."""
    value = plan.recompute
    if isinstance(value, str):
        if value != "auto":
            raise PlanError(f"Plan(recompute={value!r}) is not known; give True, False, "
                            "'auto' or one True/False per stage.")
    elif not isinstance(value, bool):
        if not isinstance(value, Sequence) or not all(isinstance(v, bool) for v in value):
            example = [True] + [False] * (plan.stages - 1)
            raise PlanError(f"Plan(recompute={value!r}) must be True, False, 'auto' or a list "
                            f"of one True/False per stage, e.g. {example}.")
        value = tuple(value)
        if len(value) != plan.stages:
            raise PlanError(f"Plan(recompute={list(value)}) gives {len(value)} values for "
                            f"stages={plan.stages}; give exactly one True/False per stage.")
    if value is True or (isinstance(value, tuple) and any(value)):
        reason = cannot_recompute(plan)
        if reason:
            shown = list(value) if isinstance(value, tuple) else value
            raise PlanError(f"Plan(recompute={shown!r}) {reason}")
    return value


def cannot_recompute(plan: Any) -> str | None:
    """Why no stage of `plan` can recompute (its schedule or weight policy), or None. "auto"
    then recomputes nothing."""
    if plan.schedule_name == "async-1f1b" and plan.consistency in ("none", "predict"):
        return (f"with schedule='async-1f1b' needs consistency='stash' or '2bw' (it is "
                f"{plan.consistency!r}): the weights step between a micro-batch's forward and "
                "its backward, and only those policies keep the weights its forward saw for "
                "the recomputed forward to see again.")
    return None


def stage_recompute(plan: Any, partition: Any) -> tuple[bool, ...]:
    """Per stage, whether it recomputes: the partition's choice where it made one (a
    non-empty `Partition.recompute`, e.g. for "auto" under a memory cap), else the plan's."""
    chosen = tuple(getattr(partition, "recompute", ()) or ())
    if chosen:
        return chosen
    value = plan.recompute
    if isinstance(value, tuple):
        return value
    return (value is True,) * plan.stages
