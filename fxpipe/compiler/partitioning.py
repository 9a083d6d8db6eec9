"""Choosing the partition: every planner by name, and the plan's choice among them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from fxpipe.cost import CostTable, Partition
from fxpipe.errors import PlanError
from fxpipe.passes.partition import ampa, balanced, csimd, even, exact, imd, params
from fxpipe.passes.partition.balanced import minmax_bounds
from fxpipe.pipeline import CompiledPipeline
from fxpipe.plan import TIMED_PARTITIONERS, VIRTUAL, Plan
from fxpipe.schedules import Schedule, build
from fxpipe.units import Unit

__all__ = ["PARTITIONERS", "choose_partition", "compare_partitioners", "compare_schedules",
           "exactly_n_stages"]


# the names Plan accepts (plan.PARTITIONERS, the same keys) and the planner each runs
PARTITIONERS = {
    "even": even, "params": params, "balanced": balanced, "ampa": ampa, "imd": imd,
    "csimd": lambda cost, stages, p=1, schedule="gpipe": csimd(cost, stages, cost.batch, p0=p,
                                                               schedule=schedule),
    "exact": exact,
}


def compare_partitioners(pipe: CompiledPipeline) -> dict[str, Partition]:
    """Every available partitioner's partition of `pipe`'s cost table, under its plan (csimd
    only when the table was timed at several micro-batch sizes: micro_batches='auto')."""
    plan = pipe.plan
    results = {}
    for name in PARTITIONERS:
        if plan.costs == "none" and name in TIMED_PARTITIONERS:
            continue
        if name == "csimd" and (len(pipe.cost.sizes) == 1 or isinstance(plan.schedule, Schedule)):
            continue  # timed at one micro-batch size only, or your schedule fixes p
        results[name] = _run(name, pipe.cost, plan, pipe.partition.micro_batches)
    return results


def choose_partition(
    model: torch.nn.Module, plan: Plan, units: Sequence[Unit], cost: CostTable
) -> Partition:
    return choose_partition_of(type(model).__name__, plan, cost)


def choose_partition_of(model_name: str, plan: Plan, cost: CostTable) -> Partition:
    """The plan's partition of `cost` (its sizes, else its partitioner's), scored for its
    schedule; `model_name` names the model in a PlanError."""
    p = plan.micro_batches if isinstance(plan.micro_batches, int) else 1
    if plan.sizes is not None:  # which cover the units (checked by the units pass)
        bounds = torch.tensor(plan.sizes).cumsum(0).tolist()
        return Partition.evaluate(cost, bounds, p, "given", schedule=_scored(plan, p))
    if plan.micro_batches == "auto" and plan.partitioner != "csimd":  # CSIMD's choice of p
        p = PARTITIONERS["csimd"](cost, plan.stages, schedule=plan.schedule).micro_batches
    try:
        return _run(plan.partitioner, cost, plan, p)
    except ValueError as error:  # the planner cannot work with this model's costs
        raise PlanError(f"Plan(partitioner={plan.partitioner!r}) cannot partition "
                        f"{model_name}: {error}.") from error


def _run(name: str, cost: CostTable, plan: Plan, p: int) -> Partition:
    """Partitioner `name`'s partition into exactly the plan's stages, scored for its schedule
    (csimd also chooses p by it)."""
    # csimd scores by the schedule's simulated step; a virtual-stage schedule's by GPipe's
    extra = {"schedule": plan.schedule} if name == "csimd" and plan.schedule not in VIRTUAL \
        else {}
    chosen = PARTITIONERS[name](cost, plan.stages, p, **extra)
    bounds = exactly_n_stages(chosen.bounds, plan.stages, cost, chosen.micro_batches)
    return Partition.evaluate(cost, bounds, chosen.micro_batches, name,
                              schedule=_scored(plan, chosen.micro_batches))


def _scored(plan: Plan, p: int) -> str | Schedule:
    """What the memory estimate counts activations by: the schedule's name, or, where it
    places several stages per device, the schedule itself (its stages' most micro-batches in
    flight), when it can run p micro-batches."""
    if plan.schedule not in VIRTUAL:
        return plan.schedule
    try:
        return build(plan.schedule, plan.stages, p, devices=plan.device_count)
    except ValueError:  # a count it cannot run: the schedule pass says so
        return plan.schedule


def compare_schedules(pipe: CompiledPipeline, schedules: Sequence[str]) -> dict[str, Partition]:
    """The plan's partition of `pipe`'s cost table under each of `schedules` (names), each
    chosen as compile would for a plan of that schedule (csimd and micro_batches='auto'
    choose p by it) and scored by its simulated step. A Plan cannot take one of them (e.g.
    async-1f1b with groups): PlanError, before any is partitioned."""
    plans = {name: dataclasses.replace(pipe.plan, schedule=name) for name in schedules}
    return {name: choose_partition_of(pipe.model_name, plan, pipe.cost)
            for name, plan in plans.items()}


def exactly_n_stages(bounds: Sequence[int], stages: int, cost: CostTable, p: int
                     ) -> tuple[int, ...]:
    """IMD and cross-search may use fewer stages than asked when more would only add links;
    the plan has a device or rank per stage, so split the slowest stages until there are
    `stages` (each where it best halves its time)."""
    bounds, (f, b, _, _) = list(bounds), cost.at(p)
    while len(bounds) < stages:
        _, start, end = max(((f + b)[a:z].sum(), a, z)
                            for a, z in zip([0, *bounds], bounds) if z - a > 1)
        bounds = sorted([*bounds, start + minmax_bounds((f + b)[start:end], 2)[0]])
    return tuple(bounds)
