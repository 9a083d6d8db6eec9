"""Memory model: what each stage holds at its peak, shared by the planners and print(pipe)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from fxpipe.schedules import Schedule, build, peak_activations

__all__ = ["StageMemory", "boundary_buffers", "in_flight", "stage_memory",
           "workspace_bytes"]


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """One stage's predicted peak, in bytes, by what holds it."""

    weights: float
    gradients: float
    optimizer: float  # the optimizer's state: slots × the weights' bytes
    activations: float  # what autograd saves, × the micro-batches in flight at the peak
    boundary: float = 0.0  # received inputs and sent outputs held between stages
    workspace: float = 0.0  # transient: a weight's new gradient before it is accumulated

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.activations
                + self.boundary + self.workspace)


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
                 boundary: float = 0.0, workspace: float = 0.0) -> StageMemory:
    """The peak of a stage made of units with these `param_bytes` and per-micro-batch
    `saved_bytes` (what autograd saves), holding `held` micro-batches' activations at once,
    trained by an optimizer with `optimizer_slots` copies of the weights (Adam: 2), plus
    `boundary` bytes of messages (`boundary_buffers`) and `workspace` (`workspace_bytes`)."""
    weights = float(np.sum(param_bytes))
    return StageMemory(weights, weights, optimizer_slots * weights,
                       held * float(np.sum(saved_bytes)), boundary, workspace)


def workspace_bytes(param_bytes: np.ndarray, grads_in: np.ndarray, grads_out: np.ndarray,
                    micro_batches: int) -> float:
    """The most a stage's backward holds beyond its activations, over its units (per unit:
    its `param_bytes`, and per micro-batch the gradients of its inputs and outputs): a
    unit's backward holds its output's gradient while it makes its input's; over several
    micro-batches a weight's new gradient is held beside .grad until added to it."""
    accumulating = np.asarray(param_bytes) if micro_batches > 1 else 0.0
    return float(np.max(np.asarray(grads_in) + grads_out + accumulating, initial=0.0))


def boundary_buffers(received: float, received_grads: float, sent: float, sent_grads: float,
                     sent_saved: float, held: int, p: int) -> float:
    """Bytes of the messages a stage holds at its peak, given per micro-batch the bytes it
    receives and sends (and their gradients, and the part of what it sends that autograd
    saves, counted in its activations already), `held` micro-batches in flight of `p`.
    As torchrun's transport runs: a stage keeps the inputs of its micro-batches in flight
    (for their backward) and one received ahead; every message it sends stays allocated until
    the step ends (sends complete at the step's flush); the gradients it will receive are
    posted ahead, all at once when it runs every forward before a backward (held == p: its
    peak is then as the backwards start, before it sends any gradient), else one. Stages of
    one process on one device hand values over without these copies: there this is an upper
    bound."""
    forwards_first = held >= p  # its peak is as its backwards start: no gradient sent yet
    return ((held + (0 if forwards_first else 1)) * received
            + p * (sent + (0.0 if forwards_first else sent_grads))
            - held * sent_saved + (p if forwards_first else 1) * received_grads)
