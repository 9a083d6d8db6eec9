"""`even`: the same number of units in every stage (the remainder goes to the last stages)."""

from __future__ import annotations

import itertools

from fxpipe.cost import CostTable, Partition
from fxpipe.memory import MemoryBudget
from fxpipe.passes.partition.capped import check_fits, fit_or_explain
from fxpipe.passes.partition.validate import check_planner_args

__all__ = ["even", "even_bounds"]


def even_bounds(units: int, stages: int) -> tuple[int, ...]:
    """Exclusive stage ends of the even split of `units` into `stages`."""
    base, extra = divmod(units, stages)
    sizes = [base + (1 if s >= stages - extra else 0) for s in range(stages)]
    return tuple(itertools.accumulate(sizes))


def even(cost: CostTable, stages: int, p: int = 1, memory: MemoryBudget | None = None
         ) -> Partition:
    """Equal unit counts per stage, ignoring costs: the baseline every planner is compared to.
    Under a `memory` cap: PlanError when a stage does not fit (a fixed rule cannot move)."""
    check_planner_args(cost, stages, p)
    cap = check_fits(cost, stages, p, memory)
    part = Partition.evaluate(cost, even_bounds(cost.units, stages), p, "even")
    return part if cap is None else fit_or_explain(cost, cap, part, "even")
