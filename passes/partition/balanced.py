"""`balanced`: the exact min-max partition of per-unit time f + b (torchgpipe's balance_by_time)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fxpipe.cost import CostTable, Partition
from fxpipe.passes.partition.validate import check_planner_args

__all__ = ["balanced", "minmax_bounds"]


def minmax_bounds(weights: Sequence[float] | np.ndarray, stages: int) -> tuple[int, ...]:
    """Stage ends of a split of `weights` into exactly `stages` non-empty contiguous stages
    whose largest stage sum is the smallest possible.

    Bisection on the cap over the floats, each probe a greedy pass that ends every stage at
    the furthest unit under the cap (a binary search in the prefix sums, O(stages·log K)).
    Greedy-furthest needs the fewest stages for a cap, so "fits in <= stages" is monotone in
    the cap and the bisection ends on the optimum, to the last bits of float rounding.
    """
    w = np.asarray(weights, dtype=np.float64)
    units = len(w)
    if units == 0 or not 1 <= stages <= units:
        raise ValueError(f"cannot split {units} weights into {stages} non-empty stages")
    if np.any(w < 0) or not np.all(np.isfinite(w)):
        raise ValueError("min-max partitioning needs finite non-negative weights")
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    # Every cap below the larger of these two fails (a unit does not fit / the total does not).
    lo = max(float(w.max()), float(prefix[-1]) / stages)
    hi = float(prefix[-1])
    if _fits(prefix, lo, stages):
        hi = lo
    else:
        while True:
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:  # lo and hi are neighbouring floats
                break
            if _fits(prefix, mid, stages):
                hi = mid
            else:
                lo = mid
    return _greedy_exact(prefix, hi, stages)


def _furthest(prefix: np.ndarray, start: int, cap: float) -> int:
    """The furthest end e with sum(units[start:e]) <= cap."""
    return int(np.searchsorted(prefix, prefix[start] + cap, side="right")) - 1


def _fits(prefix: np.ndarray, cap: float, stages: int) -> bool:
    start, units = 0, len(prefix) - 1
    for _ in range(stages):
        end = _furthest(prefix, start, cap)
        if end <= start:
            return False
        if end >= units:
            return True
        start = end
    return False


def _greedy_exact(prefix: np.ndarray, cap: float, stages: int) -> tuple[int, ...]:
    """Greedy-furthest under `cap`, but leaving one unit for each stage still to come, so the
    split has exactly `stages` stages (the reserved stages are single units, which fit)."""
    units = len(prefix) - 1
    ends, start = [], 0
    for s in range(stages):
        reserve = units - (stages - s - 1)
        end = max(start + 1, min(_furthest(prefix, start, cap), reserve))
        ends.append(end)
        start = end
    ends[-1] = units
    return tuple(ends)


def balanced(cost: CostTable, stages: int, p: int = 1) -> Partition:
    """Minimise the largest per-stage compute time f + b at `p` micro-batches (exactly N stages).

    Ignores communication and the forward/backward split; `imd` and `exact` account for both.
    """
    check_planner_args(cost, stages, p)
    f, b, _, _ = cost.at(p)
    return Partition.evaluate(cost, minmax_bounds(f + b, stages), p, "balanced")
