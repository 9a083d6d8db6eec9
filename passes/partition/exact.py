"""`exact`: the true optimum of the cost model for small K·N, and `brute_force` to check it."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np

from fxpipe.cost import CostTable, Partition
from fxpipe.memory import MemoryBudget
from fxpipe.passes.partition.balanced import OBJECTIVES, minmax_bounds, settle
from fxpipe.passes.partition.capped import Capacity, capped_minmax, check_fits
from fxpipe.passes.partition.even import even_bounds
from fxpipe.passes.partition.imd import Packing, window_min
from fxpipe.passes.partition.validate import check_planner_args

__all__ = ["brute_force", "exact"]

_MAX_UNITS = 3000  # O(K²) candidate caps: beyond this, exact is the wrong tool
_PAIR_BUDGET = 1 << 22  # floats per DP batch (pairs × units × table levels)
_MAX_CAPPED_UNITS = 400  # under a cap: a (K+1)² mask per stage and setting


def exact(cost: CostTable, stages: int, p: int = 1, objective: str = "time",
          at_most: bool = False, memory: MemoryBudget | None = None) -> Partition:
    """The partition minimising `objective` ("time": T(λ, p) with the boundary links; "rho":
    ρF + ρB) over partitions into exactly `stages` stages, or into 1..stages with `at_most`.

    Exactly N is the default because a Plan asks for N stages; `at_most=True` is the problem
    `imd` and `csimd` solve, so compare those with it. Meant for K up to a few hundred units.

    How: ρF(λ) is always a stage's forward sum or a link's forward cost, one of O(K²) candidate
    values (likewise ρB). For a cap pair (v1, v2), a DP over (stage, end unit) finds the least
    link-cost sum of a partition within the caps; the optimum is the pair minimising
    Σ(f + b) + links + (p − 1)(v1 + v2) (for "rho": v1 + v2 among feasible pairs). Pairs are
    visited by increasing v1 + v2 and pruned by a lower bound, a MASP feasibility frontier and
    an upper bound from simple partitions, so only a thin band of pairs reaches the DP.

    Under a `memory` cap, the optimum among the partitions whose stages fit, their memory
    counted as Partition.evaluate counts it (`Capacity`): a stage's memory depends on its
    units and its place and is monotone in neither its start nor its end, so the DP admits
    stage s over [start, end) through a (start, end) mask per stage and setting; where the
    budget lets a stage recompute, also recomputing (its backward b + f within v2), at the
    cost of its forward sum in T. PlanError when none fits.
    """
    check_planner_args(cost, stages, p)
    if memory is not None and memory.capped and at_most:
        raise ValueError("exact honours a memory cap with exactly N stages (a stage's memory "
                         "depends on how many there are); give at_most=False")
    if memory is not None and memory.capped and cost.units > _MAX_CAPPED_UNITS:
        raise ValueError(f"exact under a memory cap keeps an O(K²) mask per stage and "
                         f"K={cost.units} is too many; use balanced, imd or csimd")
    cap = check_fits(cost, stages, p, memory)
    if objective not in ("time", "rho"):
        raise ValueError(f"objective={objective!r}: exact optimises 'time' or 'rho'")
    if cost.units > _MAX_UNITS:
        raise ValueError(f"exact enumerates O(K²) caps and K={cost.units} is too many; "
                         f"use imd or csimd, which scale linearly in K")
    pack = Packing.of(cost, p)
    search = _PairSearch(pack, stages, at_most, objective, p, cap, cost)
    bounds = search.run()
    part = (Partition.evaluate(cost, bounds, p, "exact") if cap is None
            else cap.evaluate(cost, bounds, "exact"))
    return settle(cost, part, objective, stages, cap)


class _PairSearch:
    """One exact solve: the candidate caps, the bounds that prune them, the DP over pairs."""

    def __init__(self, pack: Packing, stages: int, at_most: bool, objective: str, p: int,
                 cap: Capacity | None = None, cost: CostTable | None = None):
        self.pack, self.stages, self.at_most, self.cap = pack, stages, at_most, cap
        self.cost, self.objective = cost, objective
        # under a cap: per stage and setting, a (start, end) mask of the stages that fit (a
        # stage's memory is monotone in neither its start nor its end)
        self.again = None if cap is None else _Again.of(pack, cap)
        total = pack.sum_f[-1] + pack.sum_b[-1]
        # value(pair) = base + link_weight · (least link sum) + rho_weight · (v1 + v2)
        if objective == "time":
            self.base, self.link_weight, self.rho_weight = total, 1.0, float(p - 1)
        else:
            self.base, self.link_weight, self.rho_weight = 0.0, 0.0, 1.0
        self.cuts = np.sort((pack.link_f + pack.link_b)[1:-1])
        self.least_links = 0.0 if at_most else float(self.cuts[: stages - 1].sum())

    def run(self) -> tuple[int, ...]:
        inf = np.array([np.inf])
        if self.rho_weight == 0:  # T at p = 1: only the link sum matters, no caps needed
            return self._traceback(inf, inf)
        bound, fallback = self._upper_bound()
        v1, v2, lower = self._band(bound)
        best_value, best_pair = bound, None
        step = self._batch()
        for lo in range(0, len(v1), step):
            if self._lower(v1[lo], v2[lo]) > best_value:
                break  # pairs come by increasing v1 + v2, so no later pair can win
            take = lo + np.flatnonzero(lower[lo: lo + step] <= best_value)
            if take.size == 0:
                continue
            c1, c2 = v1[take], v2[take]
            values = self._values(c1, c2, self._least_links(c1, c2))
            i = int(np.argmin(values))
            if values[i] <= best_value:
                best_value, best_pair = values[i], (c1[i: i + 1], c2[i: i + 1])
        if best_pair is None:  # nothing beat the bound, even by rounding: its partition is optimal
            return fallback
        return self._traceback(*best_pair)

    def _lower(self, v1: np.ndarray | float, v2: np.ndarray | float) -> np.ndarray | float:
        return self.base + self.link_weight * self.least_links + self.rho_weight * (v1 + v2)

    def _values(self, v1: np.ndarray, v2: np.ndarray, links: np.ndarray) -> np.ndarray:
        fits = np.isfinite(links)  # inf links: no partition within the caps
        links = np.where(fits, links, 0.0)
        value = self.base + self.link_weight * links + self.rho_weight * (v1 + v2)
        return np.where(fits, value, np.inf)

    def _batch(self) -> int:
        levels = (self.pack.units + 1).bit_length()
        if self.again is not None:  # the (start, end) mask per pair
            levels = max(levels, self.pack.units + 1)
        return max(1, _PAIR_BUDGET // (levels * (self.pack.units + 1)))

    def _upper_bound(self) -> tuple[float, tuple[int, ...]]:
        """The value and stage ends of the best of a few partitions with the right stage count."""
        pack, n = self.pack, self.stages
        f, b = np.diff(pack.sum_f), np.diff(pack.sum_b)
        tries = [even_bounds(pack.units, n), minmax_bounds(f + b, n)]
        if self.at_most:
            tries.append((pack.units,))
        if self.cap is not None:  # only partitions that fit; the capped min-max split always does
            tries = [t for t in tries if self.cap.settings(t) is not None]
            tries.append(capped_minmax(self.cap, f + b, 2 * f + b)[0])
            parts = [self.cap.evaluate(self.cost, t, "exact") for t in tries]  # recomputing too
            score = OBJECTIVES[self.objective]
            values = [score(part) for part in parts]
            best = int(np.argmin(values))
            return float(values[best]), tuple(tries[best])
        ends = np.full((len(tries), n), pack.units)
        for row, bounds in zip(ends, tries):
            row[: len(bounds)] = bounds
        values = self._values(*pack.scores(ends))
        best = int(np.argmin(values))
        return float(values[best]), tuple(tries[best])

    def _band(self, bound: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every cap pair that could beat the upper bound, by increasing v1 + v2, with a lower
        bound on each pair's value."""
        pack, n, slack = self.pack, self.stages, 4 * self.pack.tol
        room = (bound - self._lower(0.0, 0.0)) / self.rho_weight + slack  # v1 + v2 <= room
        f, b = np.diff(pack.sum_f), np.diff(pack.sum_b)
        low1 = max(f.max(), pack.sum_f[-1] / n) - slack
        low2 = max(b.max(), pack.sum_b[-1] / n) - slack
        v1 = _candidates(pack.sum_f, pack.link_f, low1, room - low2)
        v2 = _candidates(pack.sum_b, pack.link_b, low2, room - low1)
        if self.again is not None and self.again.again.any():  # recomputing: ρB is b + f
            v2 = np.union1d(v2, _candidates(self.again.sum_bf, pack.link_b, low2, room - low1))
        first = self._frontier(v1, v2)  # smallest feasible v2 index for each v1
        last = np.searchsorted(v2, room - v1, side="right")  # exclusive
        count = np.maximum(last - first, 0)
        rows = np.repeat(np.arange(len(v1)), count)
        cols = np.repeat(first - np.cumsum(count) + count, count) + np.arange(count.sum())
        v1, v2 = v1[rows], v2[cols]
        lower = self._lower_per_pair(v1, v2)
        keep = np.flatnonzero(lower <= bound)
        order = keep[np.argsort(v1[keep] + v2[keep], kind="stable")]
        return v1[order], v2[order], lower[order]

    def _lower_per_pair(self, v1: np.ndarray, v2: np.ndarray) -> np.ndarray:
        """A lower bound on a pair's value: a partition within caps (v1, v2) has at least
        max(Σf / v1, Σb / v2) stages, so at least that many cuts minus one."""
        if not self.at_most:
            return self._lower(v1, v2)
        pack, tol = self.pack, self.pack.tol
        need = np.maximum(np.ceil(pack.sum_f[-1] / (v1 + 2 * tol) - 1e-9),
                          np.ceil(pack.sum_b[-1] / (v2 + 2 * tol) - 1e-9))
        need = np.clip(need, 1, self.stages).astype(np.int64)
        least = np.concatenate([[0.0], np.cumsum(self.cuts)])[need - 1]
        return self.base + self.link_weight * least + self.rho_weight * (v1 + v2)

    def _frontier(self, v1: np.ndarray, v2: np.ndarray) -> np.ndarray:
        """For each v1, the index of the smallest v2 that MASP can meet in <= N stages (a lower
        bound for exactly N too); len(v2) when none can. Bisection, all v1 lanes at once."""
        lo = np.zeros(len(v1), dtype=np.int64)
        hi = np.full(len(v1), len(v2), dtype=np.int64)
        active = np.flatnonzero(lo < hi)
        while active.size:
            mid = (lo[active] + hi[active]) // 2
            fits = self.pack.pack(v1[active], v2[mid], self.stages)[0] > 0
            hi[active[fits]] = mid[fits]
            lo[active[~fits]] = mid[~fits] + 1
            active = active[lo[active] < hi[active]]
        return lo

    def _least_links(self, v1: np.ndarray, v2: np.ndarray) -> np.ndarray:
        return _links_dp(self.pack, v1, v2, self.stages, self.at_most,
                         self.again)[0]

    def _traceback(self, v1: np.ndarray, v2: np.ndarray) -> tuple[int, ...]:
        _, rows = _links_dp(self.pack, v1, v2, self.stages, self.at_most,
                            self.again, keep=True)
        finals = [row[2][0, -1] for row in rows]  # least link sum with s stages, s = 1..N
        count = int(np.argmin(finals)) + 1 if self.at_most else self.stages
        bounds, end = [], self.pack.units
        for s in range(count, 0, -1):
            bounds.append(end)
            lo, prev, reach, again, plain = (rows[s - 1][0][0], rows[s - 1][1][0],
                                             rows[s - 1][3][0], rows[s - 1][4], rows[s - 1][5])
            if again is not None:
                recomputes = not plain[1][0, end] <= again[1][0, end]
                valid, least = (again if recomputes else plain)[0][0, :, end], \
                    (again if recomputes else plain)[2][0, end]
                shifted = np.where(valid, prev - (self.again.sum_f if recomputes else 0.0),
                                   np.inf)
                end = int(np.flatnonzero(shifted == least)[-1])
                continue
            window = prev[lo[end]: end]
            end = lo[end] + int(np.flatnonzero(window == reach[end])[-1])
        return tuple(reversed(bounds))


@dataclasses.dataclass(frozen=True)
class _Again:
    """What the DP needs under a memory cap: which stages may recompute (and which may also
    not), the prefix sums of b + f, and per stage and setting a (start, end) mask of the
    ranges whose stage fits its memory cap (`Capacity.fits`)."""

    plain: np.ndarray  # (N,) bool: may run without recomputing
    again: np.ndarray  # (N,) bool: may recompute
    sum_f: np.ndarray  # (K+1,)
    sum_bf: np.ndarray  # (K+1,)
    fits: np.ndarray  # (N, K+1 start, K+1 end) bool: recomputing
    fits_plain: np.ndarray  # (N, K+1 start, K+1 end) bool: not recomputing

    @classmethod
    def of(cls, pack: Packing, cap: Capacity) -> _Again:
        none = np.zeros((pack.units + 1, pack.units + 1), dtype=bool)
        masks = [np.stack([cap.fits(s, r) if r in cap.modes[s] else none
                           for s in range(cap.stages)]) for r in (True, False)]
        return cls(np.array([False in m for m in cap.modes]),
                   np.array([True in m for m in cap.modes]), pack.sum_f,
                   pack.sum_b + pack.sum_f, *masks)


def _candidates(prefix: np.ndarray, link: np.ndarray, low: float, high: float) -> np.ndarray:
    """Sorted distinct stage sums and link costs within [low, high]: the values ρ can take."""
    values = [link[(link >= low) & (link <= high)]]
    for start in range(len(prefix) - 1):
        sums = prefix[start + 1:] - prefix[start]
        values.append(sums[(sums >= low) & (sums <= high)])
    return np.unique(np.concatenate(values))


def _links_dp(pack: Packing, v1: np.ndarray, v2: np.ndarray, stages: int, at_most: bool,
              again: _Again | None = None,
              keep: bool = False) -> tuple[np.ndarray, list]:
    """Least link-cost sum Σ(CF + CB) of a partition into exactly `stages` (or 1..stages)
    stages within caps (v1[i], v2[i]), inf when none fits, for every pair at once.

    best_s[i, e] = cut(e) + min(best_{s-1}[i, lo(e) : e]) where lo(e) is the first start whose
    stage [start, e) fits the caps (it grows with e); window minima come from a sparse table.
    `again`: under a memory cap, each stage only over the (start, end) ranges its masks admit,
    plain or recomputing (at the cost of its forward sum; see _recomputing). With `keep`,
    also returns [(lo, best_{s-1}, best_s, window min, recomputing's and plain's (valid,
    total, least) or None)...] for the traceback.
    """
    units = pack.units
    cap1, cap2 = v1[:, None] + pack.tol, v2[:, None] + pack.tol
    ends = np.arange(1, units + 1)
    timed = np.maximum(
        np.searchsorted(pack.sum_f, pack.sum_f[ends][None, :] - cap1, side="left"),
        np.searchsorted(pack.sum_b, pack.sum_b[ends][None, :] - cap2, side="left"),
    )
    timed = np.concatenate([np.zeros((len(v1), 1), np.int64), timed], axis=1)  # (pairs, K+1)
    links_fit = (pack.link_f[None, :] <= cap1) & (pack.link_b[None, :] <= cap2)
    right = np.maximum(np.arange(units + 1)[None, :] - 1, 0)
    cut = np.where(np.arange(units + 1) < units, pack.link_f + pack.link_b, 0.0)
    pairs = np.arange(len(v1))[:, None]

    best = np.full((len(v1), units + 1), np.inf)
    best[:, 0] = 0.0
    history: list = []
    finals = np.full(len(v1), np.inf)
    lo = None
    for s in range(stages):
        if lo is None:
            lo = timed
            fits = links_fit & (lo < np.arange(units + 1))
            fits[:, 0] = False
            length = np.maximum(np.arange(units + 1)[None, :] - lo, 1)
            level = np.log2(length).astype(np.int64)  # floor: windows of 2**level cover [lo, e)
            left = np.minimum(lo + (1 << level) - 1, units)
        table = window_min(best)
        reach = np.minimum(table[level, pairs, right], table[level, pairs, left])
        plain = None
        if again is None:
            new, recomputing = np.where(fits, reach + cut, np.inf), None
        else:
            plain = _recomputing(pack, again, s, best, cap1, cap2, recompute=False)
            recomputing = _recomputing(pack, again, s, best, cap1, cap2)
            new = np.where(links_fit & (np.arange(units + 1) > 0),
                           np.minimum(plain[1], recomputing[1]) + cut, np.inf)
        if keep:
            history.append((lo, best, new, reach, recomputing, plain))
        best = new
        finals = np.minimum(finals, best[:, -1]) if at_most else best[:, -1]
    return finals, history


def brute_force(cost: CostTable, stages: int, p: int = 1, objective: str | Callable = "time",
                at_most: bool = False, memory: MemoryBudget | None = None) -> Partition | None:
    """Enumerate every partition (for tests; K up to ~12): the first one minimising
    `objective`, a name in OBJECTIVES or a function of a Partition. Under a `memory` cap,
    every partition whose stages fit, each with every recompute setting the cap allows that
    fits (None when none fits)."""
    check_planner_args(cost, stages, p)
    score = OBJECTIVES[objective] if isinstance(objective, str) else objective
    counts = range(1, stages + 1) if at_most else (stages,)
    best, best_score = None, np.inf
    for n in counts:
        cap = None if memory is None else Capacity.of(cost, n, p, memory)
        for cuts in itertools.combinations(range(1, cost.units), n - 1):
            bounds = (*cuts, cost.units)
            if cap is None:
                tries = [Partition.evaluate(cost, bounds, p, "brute_force")]
            else:
                spans = list(zip((0, *cuts), bounds))
                tries = [cap.evaluate(cost, bounds, "brute_force", again)
                         for again in itertools.product(*cap.modes)
                         if all(cap.memory(s, a, e, r) <= cap.limits[s] * (1 + 1e-9)
                                for s, ((a, e), r) in enumerate(zip(spans, again)))]
            for part in tries:
                value = score(part)
                if value < best_score:
                    best, best_score = part, value
    return best



def _recomputing(pack: Packing, again: _Again, s: int, best: np.ndarray, cap1: np.ndarray,
                 cap2: np.ndarray, recompute: bool = True
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stage s over [a, e), recomputing (or not), for every pair: a within the forward cap,
    b + f (b) within the backward cap and the memory mask; the least best_{s-1}[a] +
    Σf[a:e) over such a is Σf[e] + min(best_{s-1}[a] − Σf[a]) (no Σf without recomputing).
    Returns (valid (pairs, K+1, K+1), that total per end, the min per end)."""
    units = pack.units
    ends = np.arange(units + 1)
    back = again.sum_bf if recompute else pack.sum_b
    added = again.sum_f if recompute else np.zeros(units + 1)
    lo = np.maximum(np.searchsorted(pack.sum_f, pack.sum_f[None, :] - cap1, side="left"),
                    np.searchsorted(back, back[None, :] - cap2, side="left"))
    mask = again.fits[s] if recompute else again.fits_plain[s]
    valid = mask[None, :, :] & (ends[None, :, None] >= lo[:, None, :])
    if not (again.again[s] if recompute else again.plain[s]):
        valid = np.zeros_like(valid)
    shifted = np.where(valid, (best - added)[:, :, None], np.inf)
    least = shifted.min(axis=1)
    return valid, least + added[None, :], least
