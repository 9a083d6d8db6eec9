"""`balanced`: the exact min-max partition of per-unit time f + b (torchgpipe's balance_by_time),
and how every planner breaks ties: towards balance."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fxpipe.cost import CostTable, Partition
from fxpipe.memory import MemoryBudget
from fxpipe.passes.partition.capped import Capacity, capped_step, check_fits
from fxpipe.passes.partition.even import even_bounds
from fxpipe.passes.partition.validate import check_planner_args

__all__ = ["OBJECTIVES", "TIE", "balanced", "minmax_bounds", "settle"]

OBJECTIVES: dict[str, Callable[[Partition], float]] = {
    "time": lambda part: part.predicted_time,  # T(λ, p) of ALGORITHMS §1
    "rho": lambda part: part.rho_f + part.rho_b,  # IMD's objective (ALGORITHMS §3)
    "compute": lambda part: max(s.f + s.b for s in part.stages),  # balanced's objective
    # balanced's under a cap: GPipe's closed form without links, f + b taken together
    "compute_step": lambda part: (sum(s.f + s.b for s in part.stages)
                                  + (part.micro_batches - 1) * max(s.f + s.b for s in part.stages)),
    "params": lambda part: max(s.params for s in part.stages),  # params' objective
}

# Scores this close (relative) are ties: float rounding, never a difference in the costs. Each
# planner stays optimal for the costs it is given; steadying measured costs is the profile's.
TIE = 1e-12


def settle(cost: CostTable, part: Partition, objective: str, stages: int,
           cap: Capacity | None = None) -> Partition:
    """A planner's `part`, or the most balanced partition that ties with it on `objective`, the
    same on every call: of `part`, the even split and the min-max split of f + b into
    `stages`, those scoring as `part` does (within TIE), then of those the ones with the least
    largest stage f + b, then the most stages, the fewest units in the largest stage, the most
    in the smallest, the smallest bounds (the larger stages last, as in `even`). Identical
    units so get the even split from every planner. Under a memory `cap`, only those that fit
    (recomputing where the cap allows and needs), and after the least largest f + b, those
    recomputing the least forward time."""
    p, score = part.micro_batches, OBJECTIVES[objective]
    f, b, _, _ = cost.at(p)
    others = (even_bounds(cost.units, stages), minmax_bounds(f + b, stages))
    if cap is None:
        tries = [part, *(Partition.evaluate(cost, bounds, p, part.partitioner)
                         for bounds in others)]
    else:
        tries = [part, *filter(None, (cap.evaluate(cost, bounds, part.partitioner)
                                      for bounds in others))]
    tries = [t for t in tries if abs(score(t) - score(part)) <= TIE * abs(score(part))]
    least = min(OBJECTIVES["compute"](t) for t in tries)
    tries = [t for t in tries if OBJECTIVES["compute"](t) <= least + TIE * abs(least)]
    if cap is not None:  # then the least forward time recomputed (what it adds to a step)
        fewest = min(map(_recomputed, tries))
        tries = [t for t in tries if _recomputed(t) <= fewest + TIE * abs(fewest)]
    return min(tries, key=lambda t: (-len(t.sizes), max(t.sizes), -min(t.sizes), t.bounds))


def _recomputed(part: Partition) -> float:
    return sum(s.f for s, again in zip(part.stages, part.recompute) if again)


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


def balanced(cost: CostTable, stages: int, p: int = 1, memory: MemoryBudget | None = None
             ) -> Partition:
    """Minimise the largest per-stage compute time f + b at `p` micro-batches (exactly N stages).

    Ignores communication and the forward/backward split; `imd` and `exact` account for both.
    Uncapped, that is also the least compute-only step Σ_s t_s + (p − 1)·max_s t_s (t_s =
    f + b; the sum is the same for every partition). Under a `memory` cap, that step is the
    objective, among the partitions whose every stage fits (`capped.capped_step`): a
    recomputing stage's t_s is 2f + b, so recomputing adds to the sum, and a partition with a
    larger max that recomputes less can be the faster (the least largest t_s where nothing
    need recompute, as uncapped; of equal steps, the smaller max); PlanError when none fits.
    """
    check_planner_args(cost, stages, p)
    cap = check_fits(cost, stages, p, memory)
    f, b, _, _ = cost.at(p)
    if cap is None:
        part = Partition.evaluate(cost, minmax_bounds(f + b, stages), p, "balanced")
        return settle(cost, part, "compute", stages)
    bounds, again = capped_step(cap, f, b)
    return settle(cost, cap.evaluate(cost, bounds, "balanced", again), "compute_step", stages,
                  cap)
