"""Memory model: what each stage holds at its peak, shared by the planners and print(pipe)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from fxpipe.schedules import Schedule, build, peak_activations

__all__ = ["StageMemory", "in_flight", "stage_memory"]


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
                 Sequence[float], held: int, *, optimizer_slots: float = 2.0) -> StageMemory:
    """The peak of a stage made of units with these `param_bytes` and per-micro-batch
    `saved_bytes` (what autograd saves), holding `held` micro-batches' activations at once,
    trained by an optimizer with `optimizer_slots` copies of the weights (Adam: 2)."""
    weights = float(np.sum(param_bytes))
    return StageMemory(weights, weights, optimizer_slots * weights,
                       held * float(np.sum(saved_bytes)))
