"""Plan(recompute=...): which stages recompute their forward during backward, checked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fxpipe.errors import PlanError
from fxpipe.schedules.actions import ActionKind, Schedule

__all__ = ["recompute_spec", "stage_recompute"]

# zero-bubble schedules split each backward into B (input gradients) and W (weight gradients),
# two passes over the graph: a checkpointed stage would recompute its forward in each of them
_SPLIT = ("zb-h1", "zbv")


def recompute_spec(plan: Any) -> bool | str | tuple[bool, ...]:
    """The plan's `recompute`, checked against its stages and schedule: False (no stage),
    True (every stage), "auto" (the partitioner turns it on only for the stages that need it
    to fit Plan(memory_limit=...); with no cap every stage fits, so none recomputes), or one
    bool per stage."""
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
    maybe = value is True or (isinstance(value, tuple) and any(value)) or (
        value == "auto" and getattr(plan, "memory_limit", None) is not None)
    if maybe:
        _check_schedule(plan, value)
    return value


def _check_schedule(plan: Any, value: Any) -> None:
    given = f"Plan(recompute={list(value) if isinstance(value, tuple) else value!r})"
    schedule = plan.schedule
    splits = (any(a.kind is ActionKind.W for stage in schedule.actions for a in stage)
              if isinstance(schedule, Schedule) else schedule in _SPLIT)
    if splits:
        raise PlanError(f"{given} cannot run schedule={plan.schedule_name!r}: it computes "
                        "weight gradients (W) apart from input gradients (B), and a stage "
                        "that recomputes would run its forward again for each of them; use "
                        "schedule='1f1b' or 'interleaved-1f1b', or recompute=False.")
    if plan.schedule_name == "async-1f1b" and plan.consistency in ("none", "predict"):
        raise PlanError(f"{given} with schedule='async-1f1b' needs consistency='stash' or "
                        f"'2bw' (it is {plan.consistency!r}): the weights step between a "
                        "micro-batch's forward and its backward, and only those policies keep "
                        "the weights its forward saw for the recomputed forward to see again.")


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
