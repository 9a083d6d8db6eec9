"""Choosing the partition: every planner by name, and the plan's choice among them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from fxpipe.cost import CostTable, Partition
from fxpipe.errors import PlanError
from fxpipe.memory import MemoryBudget
from fxpipe.memory_spec import optimizer_slots, stage_limits
from fxpipe.passes.partition import ampa, balanced, csimd, even, exact, imd, params
from fxpipe.passes.partition.balanced import minmax_bounds
from fxpipe.passes.partition.capped import check_fits, fit_or_explain
from fxpipe.passes.partition.odpa import divisors
from fxpipe.pipeline import CompiledPipeline
from fxpipe.plan import TIMED_PARTITIONERS, VIRTUAL, Plan
from fxpipe.recompute_spec import cannot_recompute
from fxpipe.schedules import Schedule, build
from fxpipe.units import Unit

__all__ = ["PARTITIONERS", "choose_partition", "compare_partitioners", "compare_schedules",
           "evaluate_for_plan", "exactly_n_stages", "memory_budget"]


FIXED_RULES = ("even", "params")  # their split ignores times: a count only decides if it fits
# the names Plan accepts (plan.PARTITIONERS, the same keys) and the planner each runs
PARTITIONERS = {
    "even": even, "params": params, "balanced": balanced, "ampa": ampa, "imd": imd,
    "csimd": lambda cost, stages, p=1, schedule="gpipe", memory=None: csimd(
        cost, stages, cost.batch, p0=p, schedule=schedule, memory=memory),
    "exact": exact,
}


def compare_partitioners(pipe: CompiledPipeline, failed: dict[str, str] | None = None
                         ) -> dict[str, Partition]:
    """Every available partitioner's partition of `pipe`'s cost table, under its plan (csimd
    only when the table was timed at several micro-batch sizes: micro_batches='auto'). Under a
    memory cap, a partitioner that cannot meet it is left out, and why goes into `failed`."""
    plan = pipe.plan
    results = {}
    for name in PARTITIONERS:
        if plan.costs == "none" and name in TIMED_PARTITIONERS:
            continue
        if name == "csimd" and (len(pipe.cost.sizes) == 1 or isinstance(plan.schedule, Schedule)):
            continue  # timed at one micro-batch size only, or your schedule fixes p
        try:
            results[name] = _run(name, pipe.cost, plan, pipe.partition.micro_batches)
        except ValueError as error:  # PlanError too: this one cannot meet the memory cap
            if plan.memory_limit is None:
                raise
            if failed is not None:
                failed[name] = str(error)
    return results


def choose_partition(
    model: torch.nn.Module, plan: Plan, units: Sequence[Unit], cost: CostTable
) -> Partition:
    return choose_partition_of(type(model).__name__, plan, cost)


def choose_partition_of(model_name: str, plan: Plan, cost: CostTable) -> Partition:
    """The plan's partition of `cost` (its sizes, else its partitioner's), scored for its
    schedule; `model_name` names the model in a PlanError."""
    p = plan.micro_batches if isinstance(plan.micro_batches, int) else 1
    try:
        if plan.sizes is not None:  # which cover the units (checked by the units pass)
            bounds = torch.tensor(plan.sizes).cumsum(0).tolist()
            given = evaluate_for_plan(cost, bounds, p, "given", plan)
            cap = check_fits(cost, plan.stages, p, memory_budget(plan, p))
            return given if cap is None else evaluate_for_plan(
                cost, bounds, p, "given", plan, fit_or_explain(cost, cap, given, "given"))
        if plan.micro_batches == "auto" and plan.partitioner != "csimd":  # CSIMD's choice of p
            p = PARTITIONERS["csimd"](cost, plan.stages, schedule=plan.schedule,
                                      memory=memory_budget(plan, None)).micro_batches
            if plan.partitioner in FIXED_RULES and plan.memory_limit is not None:
                return _fixed_rule_under_cap(cost, plan, p)
        return _run(plan.partitioner, cost, plan, p)
    except PlanError as error:  # the plan asks for what no partition can give
        raise PlanError(f"Plan(partitioner={plan.partitioner!r}) cannot partition "
                        f"{model_name}: {error}.") from None
    except ValueError as error:  # the planner cannot work with this model's costs
        raise PlanError(f"Plan(partitioner={plan.partitioner!r}) cannot partition "
                        f"{model_name}: {error}.") from error


def _fixed_rule_under_cap(cost: CostTable, plan: Plan, p: int) -> Partition:
    """micro_batches='auto' for a partitioner whose split ignores times (even, params) under
    a memory cap: csimd's count p where that split fits (as without a cap), else, of the
    batch's other counts at which it fits, the one it steps shortest at (the rule csimd
    chooses p by); the PlanError at p when it fits at none."""
    try:
        return _run(plan.partitioner, cost, plan, p)
    except PlanError as error:
        refused = error
    fitting = []
    for q in divisors(cost.batch):  # the counts csimd chooses among; the fewest first
        try:
            fitting.append(_run(plan.partitioner, cost, plan, q))
        except PlanError:
            continue
    if not fitting:
        raise PlanError(f"{refused} (with micro_batches='auto', at no micro-batch count of "
                        f"the batch of {cost.batch} either)") from None
    return min(fitting, key=lambda part: part.predicted_time)  # ties: the fewest


def memory_budget(plan: Plan, p: int | None) -> MemoryBudget | None:
    """What the plan's memory_limit asks of the planners at p micro-batches (None: a count
    csimd chooses), None without one. A device holding several stages gives each an equal
    share of its cap (enough for their sum to fit; the planners cap each stage)."""
    limits = stage_limits(plan)
    if limits is None:
        return None
    schedule = (plan.schedule if isinstance(plan.schedule, Schedule) or p is None
                else _scored(plan, p))
    reason = cannot_recompute(plan)
    recompute = False if plan.recompute == "auto" and reason else plan.recompute
    shared = plan.stages_per_device > 1
    return MemoryBudget(limits, schedule, optimizer_slots(plan.optimizer), recompute,
                        plan.device_count if plan.schedule in VIRTUAL else None,
                        tuple(plan.placement) if shared else (), cannot_recompute=reason,
                        consistency=plan.consistency)


def evaluate_for_plan(cost: CostTable, bounds: Sequence[int], p: int, name: str, plan: Plan,
              recompute: Partition | tuple[bool, ...] | None = None) -> Partition:
    """`bounds` scored for the plan's schedule, memory counted for its optimizer, with the
    plan's recomputation (or the given settings, or a Partition's)."""
    if isinstance(recompute, Partition):
        recompute = recompute.recompute
    if recompute is None:
        fixed = plan.recompute
        recompute = fixed if isinstance(fixed, tuple) else (fixed is True,) * len(bounds)
    return Partition.evaluate(cost, bounds, p, name, schedule=_scored(plan, p),
                              optimizer_slots=optimizer_slots(plan.optimizer),
                              recompute=recompute, consistency=plan.consistency)


def _run(name: str, cost: CostTable, plan: Plan, p: int) -> Partition:
    """Partitioner `name`'s partition into exactly the plan's stages, scored for its schedule
    (csimd also chooses p by it)."""
    # csimd scores by the schedule's simulated step; a virtual-stage schedule's by GPipe's
    extra = {"schedule": plan.schedule} if name == "csimd" and plan.schedule not in VIRTUAL \
        else {}
    memory = memory_budget(plan, None if name == "csimd" else p)
    if memory is not None:
        extra["memory"] = memory
    planned = cost  # every stage recomputing, uncapped: plan with its backward at b + f
    if memory is None and plan.recompute is True:
        planned = dataclasses.replace(cost, b=cost.b + cost.f)
    chosen = PARTITIONERS[name](planned, plan.stages, p, **extra)
    if memory is not None:  # every planner returns exactly N stages that fit under a cap
        return evaluate_for_plan(cost, chosen.bounds, chosen.micro_batches, name, plan, chosen)
    bounds = exactly_n_stages(chosen.bounds, plan.stages, cost, chosen.micro_batches)
    return evaluate_for_plan(cost, bounds, chosen.micro_batches, name, plan)


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


def compare_schedules(pipe: CompiledPipeline, schedules: Sequence[str]
                      ) -> dict[str, Partition | None]:
    """The plan's partition of `pipe`'s cost table under each of `schedules` (names), each
    chosen as compile would for a plan of that schedule (csimd and micro_batches='auto'
    choose p by it) and scored by its simulated step; None where no partition fits the
    plan's memory cap under that schedule. A Plan cannot take one of them (e.g. async-1f1b
    with groups): PlanError, before any is partitioned."""
    plans = {name: dataclasses.replace(pipe.plan, schedule=name) for name in schedules}
    return {name: _fitting(pipe.model_name, plan, pipe.cost) for name, plan in plans.items()}


def _fitting(model_name: str, plan: Plan, cost: CostTable) -> Partition | None:
    try:
        return choose_partition_of(model_name, plan, cost)
    except PlanError:
        if plan.memory_limit is None:
            raise
        return None


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
