"""Before any timing: a memory cap too small for the model's parameters alone is refused."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import fx

from fxpipe.errors import PlanError
from fxpipe.inspect import format_bytes
from fxpipe.memory_spec import DEFAULT_OPTIMIZER, optimizer_slots, stage_limits
from fxpipe.passes.partition.even import even_bounds
from fxpipe.passes.partition.least_cap import least_state_split, state_split
from fxpipe.plan import Plan
from fxpipe.units import Unit, unit_parameters

__all__ = ["check_parameters_fit"]

_SLACK = 1e-9  # relative: a stage exactly at its cap (up to float rounding) fits


def check_parameters_fit(model: torch.nn.Module, plan: Plan, gm: fx.GraphModule,
                         units: Sequence[Unit]) -> None:
    """PlanError when no partition into the plan's stages (its fixed one: given sizes or
    'even') can hold the units' weights, gradients and optimizer state under
    Plan(memory_limit=...), as the planners count them. Activations, messages and workspace
    only add to a stage's memory, so a cap refused here is one every partition exceeds."""
    limits = stage_limits(plan)
    if limits is None:
        return
    slots = optimizer_slots(plan.optimizer)
    state = (2.0 + slots) * unit_parameters(gm, units)[1]  # weights, gradients, slots
    limits = np.asarray(limits)
    largest = int(np.argmax(state))
    if plan.sizes is not None or plan.partitioner == "even":  # the partition is fixed
        bounds = (tuple(int(e) for e in np.cumsum(plan.sizes)) if plan.sizes is not None
                  else even_bounds(len(units), plan.stages))
        held = np.add.reduceat(state, (0, *bounds[:-1]))
        if np.all(held <= limits * (1 + _SLACK)):
            return
        s = int(np.argmax(held / limits))
        start = 0 if s == 0 else bounds[s - 1]
        rule = "your stage sizes" if plan.sizes is not None else "partitioner 'even'"
        where = (f"{rule} ({'+'.join(str(e - a) for a, e in zip((0, *bounds), bounds))} "
                 f"units per stage) put {format_bytes(held[s])} of it on stage {s} (units "
                 f"{start}-{bounds[s] - 1}), over its cap of {format_bytes(limits[s])}")
        other = ("a partitioner that honours the cap: 'balanced', 'exact', 'imd', 'csimd' "
                 "or 'ampa'")
    else:
        if state_split(state, limits) is not None:
            return
        bounds = least_state_split(state, limits)  # the split needing the least of the caps
        held = np.add.reduceat(state, (0, *bounds[:-1]))
        where = f"no split of its {len(units)} units into {plan.stages} stages fits them"
        other = (f"finer units (Plan(unit_depth=...)): unit {units[largest].name!r} alone "
                 f"holds {format_bytes(state[largest])}"
                 if state[largest] > limits.max() * (1 + _SLACK) else "more stages")
    optimizer = plan.optimizer if plan.optimizer is not None else DEFAULT_OPTIMIZER
    lighter = (", an optimizer with less state (Plan(optimizer='sgd') keeps none)" if slots
               else "")
    raise PlanError(
        f"Plan(memory_limit={_limit_text(plan.memory_limit)}) cannot hold "
        f"{type(model).__name__}'s parameters, before any activation: their weights, "
        f"gradients and optimizer state (optimizer {optimizer!r}: {slots:g} weight-sized "
        f"slots) take {format_bytes(state.sum())}, and {where}{_share(plan)}; give "
        f"memory_limit={_needed(plan, held)} at least (activations and messages need "
        f"more){lighter}, or {other}.")


def _needed(plan: Plan, held: np.ndarray) -> str:
    """The memory_limit under which each stage holds `held`: a device's stages get an equal
    share of its cap, so it needs its stages' largest times their count."""
    caps = plan.memory_limit if isinstance(plan.memory_limit, tuple) else None
    per_device = list(caps) if caps else [0.0] * plan.device_count
    share = plan.stages // plan.device_count
    for s, device in enumerate(plan.placement):
        per_device[device] = max(per_device[device], held[s] * share)
    if caps:
        return f"{[math.ceil(x) for x in per_device]} bytes (per device)"
    least = math.ceil(max(per_device))
    return f"{least} bytes ({format_bytes(least)})"


def _limit_text(limit: float | tuple[float, ...]) -> str:
    if isinstance(limit, tuple):
        return "[" + ", ".join(format_bytes(x) for x in limit) + "]"
    return format_bytes(limit)


def _share(plan: Plan) -> str:
    v = plan.stages // plan.device_count
    return f" (each of a device's {v} stages gets 1/{v} of its cap)" if v > 1 else ""
