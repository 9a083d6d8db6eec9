"""Memory model: what each stage holds at its peak, shared by the planners and print(pipe)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from fxpipe.schedules import Schedule, build, peak_activations

__all__ = ["MemoryBudget", "StageMemory", "in_flight", "stage_memory"]


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """One stage's predicted peak, in bytes, by what holds it."""

    weights: float
    gradients: float
    optimizer: float  # the optimizer's state: slots × the weights' bytes
    activations: float  # what autograd saves, × the micro-batches in flight at the peak
    boundary: float = 0.0  # received inputs and sent outputs held between stages

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.boundary


def in_flight(schedule: str | Schedule, stages: int, p: int,
              devices: int | None = None) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations it holds at once under `schedule`
    (a name, built for `stages` and `p`, on `devices` where it places several stages on one;
    or a user's Schedule): the schedule's own `peak_activations`."""
    if isinstance(schedule, Schedule):
        return peak_activations(schedule)
    return _named_in_flight(schedule, stages, p, devices)


@functools.lru_cache(maxsize=256)  # planners ask for the same (schedule, stages, p) many times
def _named_in_flight(name: str, stages: int, p: int, devices: int | None) -> tuple[int, ...]:
    extra = {} if devices is None else {"devices": devices}
    try:
        return peak_activations(build(name, stages, p, **extra))
    except ValueError:  # a count or placement it cannot run (the schedule pass says so): at
        return (p,) * stages  # most every micro-batch at once


def stage_memory(param_bytes: np.ndarray | Sequence[float], saved_bytes: np.ndarray |
                 Sequence[float], held: int, *, optimizer_slots: float = 2.0,
                 recompute: bool = False, input_bytes: float = 0.0) -> StageMemory:
    """The peak of a stage made of units with these `param_bytes` and per-micro-batch
    `saved_bytes` (what autograd saves), holding `held` micro-batches' activations at once,
    trained by an optimizer with `optimizer_slots` copies of the weights (Adam: 2).

    A stage that `recompute`s keeps only its `input_bytes` per micro-batch in flight, plus
    one micro-batch's saved activations while it recomputes that micro-batch's forward."""
    weights = float(np.sum(param_bytes))
    saved = float(np.sum(saved_bytes))
    activations = held * input_bytes + saved if recompute else held * saved
    return StageMemory(weights, weights, optimizer_slots * weights, activations)


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """What a planner must fit: a cap in bytes per stage (one value: every stage's; inf: no
    cap), and how a stage's memory is counted: the schedule's micro-batches in flight (a name
    built for the stages, on `devices` where it places several per device, or a Schedule),
    the optimizer's slots, and recomputation (False, True, "auto": where needed to fit, or one
    bool per stage)."""

    limit: float | tuple[float, ...] = math.inf
    schedule: str | Schedule = "gpipe"
    optimizer_slots: float = 2.0
    recompute: bool | str | tuple[bool, ...] = False
    devices: int | None = None

    def limits(self, stages: int) -> np.ndarray:
        """(stages,) the cap of each stage, in bytes."""
        if isinstance(self.limit, tuple):
            if len(self.limit) != stages:
                raise ValueError(f"the memory cap lists {len(self.limit)} stages' limits for "
                                 f"{stages} stages; give one per stage or a single value")
            return np.asarray(self.limit, dtype=np.float64)
        return np.full(stages, float(self.limit))

    def held(self, stages: int, p: int) -> tuple[int, ...]:
        return in_flight(self.schedule, stages, p, self.devices)

    def modes(self, stages: int) -> tuple[tuple[bool, ...], ...]:
        """Per stage, the recomputation settings a planner may choose from."""
        if self.recompute == "auto":
            return ((False, True),) * stages
        if isinstance(self.recompute, tuple):
            if len(self.recompute) != stages:
                raise ValueError(f"recompute lists {len(self.recompute)} stages for {stages}")
            return tuple((bool(r),) for r in self.recompute)
        return ((bool(self.recompute),),) * stages

    @property
    def may_recompute(self) -> bool:
        """Whether any stage may recompute (so its memory is not a prefix sum of its units)."""
        if isinstance(self.recompute, tuple):
            return any(self.recompute)
        return self.recompute is True or self.recompute == "auto"

    @property
    def capped(self) -> bool:
        limit = self.limit if isinstance(self.limit, tuple) else (self.limit,)
        return any(math.isfinite(x) for x in limit)
