"""Argument checks every planner shares: errors that say what is wrong and how to fix it."""

from __future__ import annotations

from fxpipe.cost import CostTable

__all__ = ["check_planner_args"]


def check_planner_args(cost: CostTable, stages: int, p: int = 1) -> None:
    """ValueError unless `cost` has units, 1 <= stages <= units and p >= 1."""
    if cost.units == 0:
        raise ValueError("the cost table has no units; build it from at least one unit's costs")
    if isinstance(stages, bool) or int(stages) != stages or stages < 1:
        raise ValueError(f"stages={stages!r} must be a positive integer (the pipeline depth N)")
    if stages > cost.units:
        raise ValueError(
            f"stages={stages} but the cost table has only {cost.units} units and every stage "
            f"needs at least one; use stages <= {cost.units} or cut the model into finer units"
        )
    if isinstance(p, bool) or int(p) != p or p < 1:
        raise ValueError(f"p={p!r} must be a positive integer number of micro-batches")
