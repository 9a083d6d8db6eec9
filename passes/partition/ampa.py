"""`ampa`: GroPipe's automatic model partitioning by performance dispersion (ALGORITHMS §2)."""

from __future__ import annotations

import numpy as np

from fxpipe.cost import CostTable, Partition, step_times
from fxpipe.memory import MemoryBudget
from fxpipe.passes.partition.balanced import balanced, settle
from fxpipe.passes.partition.capped import check_fits
from fxpipe.passes.partition.even import even_bounds
from fxpipe.passes.partition.validate import check_planner_args

__all__ = ["ampa", "dispersion"]


def dispersion(stage_times: np.ndarray) -> float:
    """GroPipe's performance dispersion Σ|T_s − μ| / (k·μ) (eq. 8 with the absolute value)."""
    mean = float(np.mean(stage_times))
    if mean <= 0.0:
        return 0.0  # every stage costs nothing: perfectly balanced
    return float(np.abs(stage_times - mean).sum() / (len(stage_times) * mean))


def ampa(
    cost: CostTable,
    stages: int,
    p: int = 1,
    normalize: bool = False,
    threshold: float = 0.05,
    max_rounds: int | None = None,
    memory: MemoryBudget | None = None,
) -> Partition:
    """Start from the even split and shift units from the slowest stage toward the fastest one
    until the dispersion of the stage times f + b falls below `threshold`.

    A round moves every boundary between the max and the min stage one unit toward the max
    stage: the min stage gains a unit, the max stage loses one, the stages between keep their
    size. `normalize=True` first maps the unit times to [0, 1] (GroPipe's eq. 9, which weighs the
    cheapest unit as 0). Guards the paper leaves out: no round empties a stage, at most
    `max_rounds` rounds (default N·K); of the partitions seen on the way whose maximum stage
    time (real, not normalised) is no larger than the even split's, the one with the smallest
    predicted step time T(λ, p) is returned (ties: the smallest maximum stage time), so AMPA
    is never worse than the even split by either measure.

    Under a `memory` cap: of every partition the rounds visited that fits (recomputing where
    allowed and needed) and balanced's under the cap, the one with the least T(λ, p);
    PlanError when none fits.
    """
    check_planner_args(cost, stages, p)
    cap = check_fits(cost, stages, p, memory)
    if threshold < 0:
        raise ValueError(f"threshold={threshold} must be >= 0 (a dispersion, e.g. 0.05)")
    f, b, _, _ = cost.at(p)
    real = np.concatenate([[0.0], np.cumsum(f + b)])
    steer = real if not normalize else np.concatenate([[0.0], np.cumsum(_normalized(f + b))])
    rounds = stages * cost.units if max_rounds is None else max_rounds

    ends = np.array(even_bounds(cost.units, stages))
    even_max = _stage_sums(real, ends).max()
    seen = {ends.tobytes()}
    visited, every = [ends.copy()], [ends.copy()]
    for _ in range(rounds):
        times = _stage_sums(steer, ends)
        if dispersion(times) < threshold:
            break
        hi, lo = int(np.argmax(times)), int(np.argmin(times))
        starts = np.concatenate([[0], ends[:-1]])
        if ends[hi] - starts[hi] < 2 or hi == lo:
            break  # a one-unit slowest stage cannot shrink: its time is a lower bound anyway
        # boundaries strictly between the two stages move one unit toward the max stage
        if hi < lo:
            ends[hi:lo] -= 1
        else:
            ends[lo:hi] += 1
        state = ends.tobytes()
        if state in seen:
            break  # the rounds are deterministic: from here on they only repeat
        seen.add(state)
        every.append(ends.copy())
        if _stage_sums(real, ends).max() <= even_max:
            visited.append(ends.copy())
    if cap is not None:
        fitting = [cap.evaluate(cost, tuple(int(e) for e in v), "ampa") for v in every]
        fitting.append(cap.evaluate(cost, balanced(cost, stages, p, memory).bounds, "ampa"))
        fitting = [part for part in fitting if part is not None]
        fastest = min(part.predicted_time for part in fitting)
        best = min((part for part in fitting if part.predicted_time <= fastest * (1 + 1e-12)),
                   key=lambda part: max(s.f + s.b for s in part.stages))
        return settle(cost, best, "time", stages, cap)
    times = np.array([step_times(cost, tuple(v), [p])[0] for v in visited])
    fastest = [v for v, t in zip(visited, times) if t <= times.min() * (1 + 1e-12)]
    best = min(fastest, key=lambda v: _stage_sums(real, v).max())  # ties: the balanced one
    return settle(cost, Partition.evaluate(cost, tuple(best), p, "ampa"), "time", stages)


def _stage_sums(prefix: np.ndarray, ends: np.ndarray) -> np.ndarray:
    return prefix[ends] - prefix[np.concatenate([[0], ends[:-1]])]


def _normalized(t: np.ndarray) -> np.ndarray:
    spread = t.max() - t.min()
    return (t - t.min()) / spread if spread > 0 else np.zeros_like(t)
