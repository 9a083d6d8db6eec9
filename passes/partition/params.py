"""`params`: equal parameter counts per stage (DeepSpeed's partition_method="parameters")."""

from __future__ import annotations

from fxpipe.cost import CostTable, Partition
from fxpipe.memory import MemoryBudget
from fxpipe.passes.partition.balanced import minmax_bounds, settle
from fxpipe.passes.partition.capped import check_fits, fit_or_explain
from fxpipe.passes.partition.validate import check_planner_args

__all__ = ["params"]


def params(cost: CostTable, stages: int, p: int = 1, memory: MemoryBudget | None = None
           ) -> Partition:
    """Minimise the largest per-stage parameter count (exactly N stages); times are ignored.
    Under a `memory` cap: PlanError when a stage does not fit (a fixed rule cannot move)."""
    check_planner_args(cost, stages, p)
    if not cost.params.any():
        raise ValueError(
            "the cost table holds no parameter counts (all zero), so 'params' has nothing to "
            "balance; build it with CostTable.from_arrays(..., params=...) or use 'even'"
        )
    cap = check_fits(cost, stages, p, memory)
    part = Partition.evaluate(cost, minmax_bounds(cost.params, stages), p, "params")
    part = settle(cost, part, "params", stages)
    return part if cap is None else fit_or_explain(cost, cap, part, "params")
