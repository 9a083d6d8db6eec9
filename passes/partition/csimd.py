"""`csimd`: CSIMD's cross-search, alternating IMD (partition) and ODPA (micro-batch count)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fxpipe.cost import CostTable, Partition, step_times
from fxpipe.memory import MemoryBudget
from fxpipe.passes.partition.balanced import TIE, balanced, settle
from fxpipe.passes.partition.capped import Capacity, capacities
from fxpipe.passes.partition.imd import imd
from fxpipe.passes.partition.odpa import divisors, odpa
from fxpipe.passes.partition.scheduled import (
    best_by_schedule,
    check_schedule_name,
    step_lower_bounds,
)
from fxpipe.passes.partition.validate import check_planner_args

__all__ = ["CrossSearch", "Visit", "cross_search", "csimd"]


@dataclasses.dataclass(frozen=True)
class Visit:
    """One (λ, p) the search evaluated, and whether it became the current solution."""

    bounds: tuple[int, ...]
    micro_batches: int
    time: float
    accepted: bool


@dataclasses.dataclass(frozen=True)
class CrossSearch:
    """The result of a cross-search: the partition (scored at the chosen p) and its trace."""

    partition: Partition
    visits: tuple[Visit, ...]

    @property
    def time(self) -> float:
        return self.partition.predicted_time


def cross_search(
    cost: CostTable,
    stages: int,
    batch: int | None = None,
    p0: int = 1,
    candidates: Sequence[int] | None = None,
    eta: int = 1000,
    sweep: bool = False,
) -> CrossSearch:
    """Alternate λ ← IMD(p) and p ← ODPA(λ) while T(λ, p) strictly decreases.

    Starts from (IMD(p0), p0). A new p is kept when it lowers T for the current λ, a new λ when
    it lowers T at the current p; the search stops at the first step that does not. T strictly
    decreases, so it ends, and the result is never worse than the start. Candidates default to
    the divisors of `batch` (default: the table's batch). With `sweep`, IMD then runs at every
    candidate p not yet partitioned, and a better (λ, p) found there is accepted too.
    """
    check_planner_args(cost, stages, p0)
    candidates = _candidates(cost, batch, candidates)

    def time_of(bounds: tuple[int, ...], p: int) -> float:
        return float(step_times(cost, bounds, [p])[0])

    p = p0
    bounds = imd(cost, stages, p, eta).bounds
    best = time_of(bounds, p)
    visits = [Visit(bounds, p, best, True)]
    while True:
        p_new, times = odpa(cost, bounds, candidates)
        t_new = float(times.min())
        visits.append(Visit(bounds, p_new, t_new, t_new < best))
        if not t_new < best:
            break
        p, best = p_new, t_new
        bounds_new = imd(cost, stages, p, eta).bounds
        t_new = time_of(bounds_new, p)
        visits.append(Visit(bounds_new, p, t_new, t_new < best))
        if not t_new < best:
            break
        bounds, best = bounds_new, t_new
    if sweep:
        partitioned = {v.micro_batches for v in visits[::2]}  # IMD's visits: 0, 2, 4, ...
        for q in sorted(set(candidates) - partitioned):
            bounds_q = imd(cost, stages, q, eta).bounds
            t_q = time_of(bounds_q, q)
            visits.append(Visit(bounds_q, q, t_q, t_q < best))
            if t_q < best:
                bounds, p, best = bounds_q, q, t_q
    return CrossSearch(Partition.evaluate(cost, bounds, p, "csimd"), tuple(visits))


def _candidates(cost: CostTable, batch: int | None, candidates: Sequence[int] | None
                ) -> list[int]:
    if candidates is not None:
        return list(candidates)
    batch = cost.batch if batch is None else batch
    if batch is None:
        raise ValueError("csimd chooses p among the divisors of the mini-batch size: pass "
                         "batch=..., candidates=[...], or a CostTable with batch set")
    return divisors(batch)


def csimd(
    cost: CostTable,
    stages: int,
    batch: int | None = None,
    p0: int = 1,
    candidates: Sequence[int] | None = None,
    eta: int = 1000,
    schedule: str = "gpipe",
    memory: MemoryBudget | None = None,
) -> Partition:
    """Joint partition and micro-batch count: cross-search, completed by IMD at the candidate
    p it did not reach; the Partition's micro_batches is the chosen p. See `cross_search` for
    the trace of (λ, p, T) visited.

    The search scores with the closed form, which is GPipe's simulated step. For another
    `schedule` (a name of `SCORED_SCHEDULES`), every partition it met (IMD's at each candidate
    p, and the closed form's choice) is then paired with every candidate p, and the pair whose
    step `schedule` simulates shortest is chosen (exactly, pruned by lower bounds:
    `best_by_schedule`); it is the closed form's choice unless a pair is shorter, so knowing
    the schedule never makes the step longer. Its predicted_time is then the simulated step.

    Cross-search is a coordinate descent that can stop short of the joint optimum where the
    best partition changes with p; completing it with IMD at every candidate p (milliseconds
    for hundreds of units) puts it within IMD's bound of the optimum whenever links are free.

    Under a `memory` cap, only the counts at which some partition fits are searched (fewer
    samples per micro-batch save fewer activation bytes, but more may be in flight): IMD and
    balanced under the cap at each of them, every partition found paired with every count it
    fits at, the shortest step chosen. PlanError when no count fits.
    """
    check_schedule_name(schedule, "csimd")
    if memory is not None and memory.capped:
        check_planner_args(cost, stages, p0)
        counts = _candidates(cost, batch, candidates)
        caps = capacities(cost, stages, counts, memory)  # PlanError when no count fits
        free = csimd(cost, stages, batch, p0, candidates, eta, schedule)
        fitting = (caps[free.micro_batches].evaluate(cost, free.bounds, "csimd")
                   if free.micro_batches in caps and len(free.bounds) == stages else None)
        if fitting is not None and not any(fitting.recompute):  # the cap changes nothing
            return (fitting if schedule == "gpipe" else Partition.evaluate(
                cost, fitting.bounds, fitting.micro_batches, "csimd", schedule=schedule,
                recompute=fitting.recompute, memory=memory))
        return _capped(cost, stages, caps, eta, schedule, memory)
    search = cross_search(cost, stages, batch, p0, candidates, eta, sweep=True)
    found = settle(cost, search.partition, "time", stages)
    if schedule == "gpipe":
        return found
    partitions = {v.bounds for v in search.visits} | {found.bounds}
    return best_by_schedule(cost, partitions, _candidates(cost, batch, candidates), schedule,
                            found)


def _capped(cost: CostTable, stages: int, caps: dict[int, Capacity], eta: int, schedule: str,
            memory: MemoryBudget) -> Partition:
    """IMD's and balanced's partitions under the cap at every count that fits, each paired
    with every count it fits at; the pair with the shortest step, simulated in the order of
    a lower bound on it (recomputing only lengthens a step) until no later pair can win."""
    found = {planner(cost, stages, q, memory=memory).bounds for q in caps
             for planner in (lambda c, n, q, memory: imd(c, n, q, eta, memory=memory), balanced)}
    counts = sorted(caps)
    pairs = sorted((float(bound), bounds, q) for bounds in found for q, bound in
                   zip(counts, step_lower_bounds(cost, bounds, counts, schedule)))
    best = None
    for bound, bounds, q in pairs:
        if best is not None and bound * (1 - 1e-9) >= best.predicted_time:  # float rounding
            break
        part = caps[q].evaluate(cost, bounds, "csimd")
        if part is not None and schedule != "gpipe":
            part = Partition.evaluate(cost, bounds, q, "csimd", schedule=schedule,
                                      recompute=part.recompute, memory=memory)
        if part is not None and (best is None or
                                 part.predicted_time < best.predicted_time * (1 - TIE)):
            best = part
    if schedule == "gpipe":
        return settle(cost, best, "time", stages, caps[best.micro_batches])
    return best
