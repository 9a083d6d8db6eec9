"""Memory caps for the planners: which stages fit, splits under caps, the smallest cap that fits."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fxpipe.cost import CostTable, Partition
from fxpipe.errors import PlanError
from fxpipe.memory import FIELDS, MemoryBudget
from fxpipe.passes.partition.cap_message import format_bytes, no_fit_message
from fxpipe.passes.partition.least_cap import frontier, least_scale, row_terms, walk_fields
from fxpipe.passes.partition.odpa import divisors
from fxpipe.segments import recompute_table

__all__ = ["Capacity", "Timing", "capacities", "capped_minmax", "capped_step", "check_fits",
           "fit_or_explain", "smallest_scale", "split_lanes", "stage_dp", "trace_lane"]

_SLACK = 1e-9  # relative: a stage exactly at its cap (up to float rounding) fits
RANGED = ("workspace", "kept", "segment")  # FIELDS that depend on the whole range [a, e)


@dataclasses.dataclass(frozen=True)
class Timing:
    """A time cap per lane on a per-unit time: `plain` and, for a recomputing stage, `again`
    (its forward runs twice), as prefix sums; `tol` absolute slack."""

    plain: np.ndarray  # (K+1,)
    again: np.ndarray  # (K+1,)
    caps: np.ndarray  # (L,)
    tol: float = 0.0


@dataclasses.dataclass(frozen=True, eq=False)
class Capacity:
    """Each stage's memory in an N-stage pipeline at p micro-batches, exactly as
    `Partition.evaluate` counts it: `table[s][r][a, e]` is stage s over units [a, e) with
    recomputation r (inf where e <= a). It is weights, gradients and optimizer slots (a
    prefix-sum difference) plus the most the stage's actions hold at once, max over the steps
    t of `stage_terms` · fields(a, e): saved activations (a prefix-sum difference), what
    crosses the cuts a - 1 and e - 1 (received, sent, their gradients), the backward's
    workspace (the largest over the units) and, recomputing, what its segments keep at
    their cuts and the largest one saves (`recompute_table`, O(M·K²·w) once per p)."""

    limits: np.ndarray  # (N,) bytes
    modes: tuple[tuple[bool, ...], ...]  # per stage: the recompute settings allowed
    table: tuple[dict[bool, np.ndarray], ...]  # per stage, per setting: (K+1, K+1) bytes
    held: tuple[int, ...]
    micro_batches: int
    budget: MemoryBudget

    @classmethod
    def of(cls, cost: CostTable, stages: int, p: int, budget: MemoryBudget) -> Capacity:
        modes = budget.modes(stages)
        fields = _fields(cost, p, any(True in m for m in modes))
        units = np.arange(cost.units + 1)
        empty = units[None, :] <= units[:, None]  # e <= a: no stage
        step = np.empty(empty.shape)
        table = []
        for s in range(stages):
            per = {}
            kept = budget.kept(cost.param_bytes, cost.weight_cast_bytes, stages, p, s)
            for r in modes[s]:
                memory = np.full(empty.shape, -np.inf)
                for row in frontier(budget.terms(stages, p, s, r).sum(axis=1)):
                    start, end = row_terms(row, fields, s, s == stages - 1)
                    np.add((start - kept)[:, None], (end + kept)[None, :], out=step)
                    for name in RANGED:  # fields of the whole range [a, e)
                        if row[FIELDS.index(name)]:
                            step += fields[name] * row[FIELDS.index(name)]
                    np.maximum(memory, step, out=memory)
                memory[empty] = np.inf
                if s:  # a later stage never starts at unit 0
                    memory[0] = np.inf
                per[r] = memory
            table.append(per)
        return cls(budget.limits(stages), modes, tuple(table),
                   tuple(int(h) for h in budget.held(stages, p)), p, budget)

    @property
    def stages(self) -> int:
        return len(self.limits)

    @property
    def units(self) -> int:
        return self.table[0][self.modes[0][0]].shape[0] - 1

    def memory(self, s: int, start: int, end: int, recompute: bool) -> float:
        return float(self.table[s][recompute][start, end])

    def fits(self, s: int, recompute: bool, scale: float = 1.0) -> np.ndarray:
        """(K+1, K+1) whether stage s over [a, e) fits its cap × scale."""
        return self.table[s][recompute] <= self.limits[s] * scale * (1 + _SLACK)

    def far(self, s: int, recompute: bool, scale: float = 1.0) -> np.ndarray:
        """(K+1,) per start unit, the furthest end of stage s such that it fits its cap ×
        scale ending there and at every end before (memory is not monotone in the end)."""
        units = np.arange(self.units + 1)
        bad = ~self.fits(s, recompute, scale) & (units[None, :] > units[:, None])
        ends = np.where(bad.any(axis=1), bad.argmax(axis=1) - 1, self.units)
        return np.maximum(ends, units)

    def settings(self, bounds: Sequence[int], scale: float = 1.0) -> tuple[bool, ...] | None:
        """Per stage, the cheapest allowed recompute setting under which it fits (no
        recomputation where it fits without), or None when some stage fits under none."""
        chosen = []
        for s, (start, end) in enumerate(zip((0, *bounds[:-1]), bounds)):
            fits = [r for r in self.modes[s]
                    if self.memory(s, start, end, r) <= self.limits[s] * scale * (1 + _SLACK)]
            if not fits:
                return None
            chosen.append(fits[0])  # modes list False first
        return tuple(chosen)

    def evaluate(self, cost: CostTable, bounds: Sequence[int], planner: str,
                 recompute: Sequence[bool] | None = None) -> Partition | None:
        """`bounds` scored at this p with the cheapest recompute settings that fit (or those
        given), memory counted by the budget; None when it does not fit."""
        settings = self.settings(bounds) if recompute is None else tuple(recompute)
        if settings is None:
            return None
        return Partition.evaluate(cost, bounds, self.micro_batches, planner, recompute=settings,
                                  memory=self.budget)

    def ratio(self, bounds: Sequence[int], recompute: Sequence[bool]) -> tuple[float, int]:
        """The largest memory / cap over the stages, and the stage where it is."""
        ratios = [self.memory(s, a, e, r) / self.limits[s] for s, (a, e, r) in
                  enumerate(zip((0, *bounds[:-1]), bounds, recompute))]
        s = int(np.argmax(ratios))
        return ratios[s], s


def _fields(cost: CostTable, p: int, recompute: bool) -> dict[str, np.ndarray]:
    """`walk_fields`, and (K+1, K+1) per range of units [a, e) the workspace's maxima over
    them and, where some stage may `recompute`, its segments' (`recompute_table`)."""
    units = np.arange(cost.units + 1)
    unit = np.concatenate([[-np.inf], cost.unit_workspace(p)])  # [e]: unit e - 1's
    work = np.where(units[None, :] > units[:, None], unit[None, :], -np.inf)
    kept, segment = (recompute_table(cost, p) if recompute else
                     (np.zeros((cost.units + 1,) * 2),) * 2)
    return {**walk_fields(cost, p), "kept": kept, "segment": segment,
            "workspace": np.maximum(np.maximum.accumulate(work, axis=1), 0.0)}


def _lane_far(cap: Capacity, s: int, timings: Sequence[Timing], lanes: int,
              scale: float) -> np.ndarray:
    """(modes, L, K+1): per allowed setting of stage s, per lane and start, the furthest end."""
    out = []
    for rc in cap.modes[s]:
        ends = np.broadcast_to(cap.far(s, rc, scale), (lanes, cap.units + 1))
        for t in timings:
            prefix = t.again if rc else t.plain
            limit = prefix[None, :] + t.caps[:, None] + t.tol
            ends = np.minimum(ends, np.searchsorted(prefix, limit, side="right") - 1)
        out.append(ends)
    return np.stack(out)


def _reach(cap: Capacity, timings: Sequence[Timing], ok: np.ndarray | None, lanes: int,
           scale: float, keep: bool = False) -> tuple[np.ndarray, list]:
    """Which ends each lane reaches with exactly s stages, s = 1..N (stage s from any reached
    start a to any end in (a, far_s(a)], a non-last stage only where `ok`)."""
    units = cap.units
    reach = np.zeros((lanes, units + 1), dtype=bool)
    reach[:, 0] = True
    history = []
    index = np.arange(1, units + 1)
    for s in range(cap.stages):
        far = _lane_far(cap, s, timings, lanes, scale)
        best = np.maximum.accumulate(np.where(reach, far.max(0), -1), axis=1)
        new = np.zeros_like(reach)
        new[:, 1:] = best[:, :-1] >= index
        if ok is not None and s < cap.stages - 1:
            new &= ok
        if keep:
            history.append((reach, far))
        reach = new
    return reach[:, units], history


def split_lanes(cap: Capacity, timings: Sequence[Timing], ok: np.ndarray | None = None,
                scale: float = 1.0) -> np.ndarray:
    """(L,) whether each lane's caps admit a partition into exactly N stages that fit."""
    lanes = len(timings[0].caps) if timings else 1
    return _reach(cap, timings, ok, lanes, scale)[0]


def trace_lane(cap: Capacity, timings: Sequence[Timing], ok: np.ndarray | None = None,
               scale: float = 1.0) -> tuple[tuple[int, ...], tuple[bool, ...]] | None:
    """For one lane, a partition into exactly N stages within the caps (each stage ending as
    late as it can, preferring no recomputation) and its recompute settings, or None."""
    fits, history = _reach(cap, timings, ok, 1, scale, keep=True)
    if not fits[0]:
        return None
    end, bounds, again = cap.units, [], []
    for s in range(cap.stages - 1, -1, -1):
        reach, far = history[s]
        starts = np.flatnonzero(reach[0, :end])
        for m, rc in enumerate(cap.modes[s]):  # the cheapest setting that reaches `end`
            good = starts[far[m, 0, starts] >= end]
            if good.size:
                bounds.append(end)
                again.append(rc)
                end = int(good[-1])
                break
    return tuple(reversed(bounds)), tuple(reversed(again))


def _fitting_sums(cap: Capacity, plain: np.ndarray, twice: np.ndarray
                  ) -> list[dict[bool, np.ndarray]]:
    """Per stage and allowed setting, (K+1, K+1) the sum over [a, e) from the prefix sums
    `plain` (`twice` recomputing), inf where the stage does not fit."""
    sums = {False: plain[None, :] - plain[:, None], True: twice[None, :] - twice[:, None]}
    return [{r: np.where(cap.fits(s, r), sums[r], np.inf) for r in cap.modes[s]}
            for s in range(cap.stages)]


def capped_minmax(cap: Capacity, weights: np.ndarray, again: np.ndarray | None = None,
                  forward: np.ndarray | None = None
                  ) -> tuple[tuple[int, ...], tuple[bool, ...]] | None:
    """The partition into exactly N stages that fit whose largest stage sum of `weights`
    (`again` for a recomputing stage) is the least, by a DP over (stage, end) on the fit
    tables; None when none fits. With `forward` (per-unit times), of those the one
    recomputing the least forward time (what recomputation adds to a step)."""
    plain = np.concatenate([[0.0], np.cumsum(weights)])
    twice = plain if again is None else np.concatenate([[0.0], np.cumsum(again)])
    costs = _fitting_sums(cap, plain, twice)
    value, bounds, settings = _bottleneck(cap, costs)
    if not np.isfinite(value):
        return None
    if forward is None or not any(settings):
        return bounds, settings
    tol = 1e-12 * max(float(twice[-1]), float(plain[-1]), 1e-300)
    return _least_added(cap, costs, forward, value + tol)[1:]


def capped_step(cap: Capacity, f: np.ndarray, b: np.ndarray
                ) -> tuple[tuple[int, ...], tuple[bool, ...]] | None:
    """The partition into exactly N stages that fit whose compute-only step Σ_s t_s +
    (p − 1)·max_s t_s is the least (t_s: the stage's f + b, 2f + b recomputing; GPipe's
    closed form without links, forward and backward taken together), None when none fits.

    Without recomputation Σ t_s is the same for every partition, so this is the min-max
    split (`capped_minmax`'s). With it, Σ t_s grows by the forward time recomputed, A(V) the
    least of it over the partitions whose every t_s <= V, which falls as V grows: the least
    step is at V*, the min-max, or at a V where A(V) drops, V < V* + A(V*)/(p − 1) and no
    larger than the largest t_s of the partition recomputing the least of all. Those drops
    are found by bisection on the distinct stage times between, one `_least_added` DP per
    probe. Ties: the smaller largest stage time."""
    p = cap.micro_batches
    plain = np.concatenate([[0.0], np.cumsum(f + b)])
    twice = np.concatenate([[0.0], np.cumsum(2 * f + b)])
    costs = _fitting_sums(cap, plain, twice)
    value, bounds, settings = _bottleneck(cap, costs)
    if not np.isfinite(value):
        return None
    if not any(settings):  # nothing recomputed: Σ t_s is the least there is, max t_s too
        return bounds, settings
    tol = 1e-12 * max(float(twice[-1]), 1e-300)
    slack = 1e-12 * max(float(np.sum(f)), 1e-300)  # of A
    added, *best = _least_added(cap, costs, f, value + tol)
    if added <= slack:
        return tuple(best[0]), tuple(best[1])
    largest = max(float(c[np.isfinite(c)].max(initial=0.0)) for per in costs
                  for c in per.values())
    _, ends, again = _least_added(cap, costs, f, largest + tol)
    top = max((twice if r else plain)[e] - (twice if r else plain)[a]
              for a, e, r in zip((0, *ends[:-1]), ends, again))
    if p > 1:
        top = min(top, value + added / (p - 1))
    values = np.unique(np.concatenate([c[(c > value + tol) & (c <= top + tol)]
                                       for per in costs for c in per.values()]))
    score, lo = added + (p - 1) * value, 0
    while added > slack:
        # a larger V can win only while (p − 1)·V < score (A >= 0)
        hi = len(values) if p == 1 else int(np.searchsorted(values, score / (p - 1), "left"))
        if lo >= hi or _least_added(cap, costs, f, values[hi - 1] + tol)[0] >= added - slack:
            break  # no V in reach recomputes less
        while lo < hi - 1:  # the least V in values[lo:hi] recomputing less than `added`
            mid = (lo + hi - 1) // 2
            if _least_added(cap, costs, f, values[mid] + tol)[0] < added - slack:
                hi = mid + 1
            else:
                lo = mid + 1
        added, *found = _least_added(cap, costs, f, values[lo] + tol)
        if added + (p - 1) * values[lo] < score - slack:
            score, best = added + (p - 1) * values[lo], found
        lo += 1
    return tuple(best[0]), tuple(best[1])


def _least_added(cap: Capacity, costs: list[dict[bool, np.ndarray]], forward: np.ndarray,
                 most: float) -> tuple[float, tuple[int, ...], tuple[bool, ...]]:
    """Of the partitions whose every stage costs <= `most` (costs as `_bottleneck`'s), the
    one recomputing the least forward time: that time, its bounds and settings."""
    fwd = np.concatenate([[0.0], np.cumsum(forward)])
    added = np.maximum(fwd[None, :] - fwd[:, None], 0.0)
    return stage_dp(cap, [{r: np.where(c <= most, added if r else 0.0, np.inf)
                      for r, c in per.items()} for per in costs], np.add)


def _bottleneck(cap: Capacity, costs: list[dict[bool, np.ndarray]]
                ) -> tuple[float, tuple[int, ...], tuple[bool, ...]]:
    """The least over partitions into N stages of the largest stage cost (costs[s][r][a, e],
    inf: not allowed), its bounds and settings: best_s(e) = min_a max(best_{s-1}(a), c)."""
    return stage_dp(cap, costs, np.maximum)


def stage_dp(cap: Capacity, costs: list[dict[bool, np.ndarray]], combine
             ) -> tuple[float, tuple[int, ...], tuple[bool, ...]]:
    """The partition into N stages least in its stage costs (costs[s][r][a, e], inf: not
    allowed) combined by `combine` (np.maximum: the largest; np.add: the sum), with its
    bounds and settings; (inf, (), ()) when none is allowed."""
    units = cap.units
    best = np.full(units + 1, np.inf)
    best[0] = 0.0 if combine is np.add else -np.inf
    steps = []
    for per in costs:
        options = np.stack([combine(best[:, None], per[r]) for r in per])  # (modes, a, e)
        flat = options.reshape(-1, units + 1)
        pick = flat.argmin(axis=0)
        steps.append((pick // (units + 1), pick % (units + 1), tuple(per)))
        best = flat[pick, np.arange(units + 1)]
    value = float(best[units])
    if not np.isfinite(value):
        return np.inf, (), ()
    bounds, settings, e = [], [], units
    for mode, start, names in reversed(steps):
        bounds.append(e)
        settings.append(names[int(mode[e])])
        e = int(start[e])
    return value, tuple(reversed(bounds)), tuple(reversed(settings))


def smallest_scale(cap: Capacity) -> tuple[float, tuple[int, ...], tuple[bool, ...]]:
    """The least s such that every cap × s admits a partition, and that partition (exact: the
    least over partitions of the largest memory / cap over the stages)."""
    costs = [{r: cap.table[s][r] / cap.limits[s] for r in cap.modes[s]}
             for s in range(cap.stages)]
    value, bounds, again = _bottleneck(cap, costs)
    # prefer no recomputation where it fits as well
    again = cap.settings(bounds, value) or again
    return value, bounds, again


def check_fits(cost: CostTable, stages: int, p: int, budget: MemoryBudget | None
               ) -> Capacity | None:
    """The Capacity to plan under, None without a cap; PlanError, before any search, when no
    partition into `stages` fits at p micro-batches (naming the smallest cap that would)."""
    if budget is None or not budget.capped:
        return None
    scale, bounds, again = least_scale(cost, stages, p, budget)  # fast, without the tables
    if scale <= 1 + _SLACK:
        return Capacity.of(cost, stages, p, budget)
    message = no_fit_message(cost, p, budget, scale, bounds, again)
    if cost.batch is not None and len(cost.sizes) > 1:  # measured at several micro-batch
        # sizes, so another count may fit where this one does not
        others = [q for q in divisors(cost.batch) if q != p and
                  least_scale(cost, stages, q, budget)[0] <= 1 + _SLACK]
        if others:
            message += (f"; micro_batches={others[0]} fits (or micro_batches='auto', which "
                        "chooses among the counts that fit)")
    raise PlanError(message)


def capacities(cost: CostTable, stages: int, counts: Sequence[int], budget: MemoryBudget
               ) -> dict[int, Capacity]:
    """Per micro-batch count in `counts` at which some partition into `stages` fits, its
    Capacity; PlanError, before any search, when none does (naming the smallest cap over
    every count, at the count that needs the least)."""
    found, least = {}, None
    for q in counts:
        scale, bounds, again = least_scale(cost, stages, q, budget)
        if scale <= 1 + _SLACK:
            found[q] = Capacity.of(cost, stages, q, budget)
        elif least is None or scale < least[0]:
            least = (scale, q, bounds, again)
    if not found:
        scale, q, bounds, again = least
        raise PlanError(no_fit_message(cost, q, budget, scale, bounds, again, every_count=True)
                        + f" (no micro-batch count of {sorted(counts)} fits; this one needs "
                        "the least)")
    return found


def fit_or_explain(cost: CostTable, cap: Capacity, part: Partition, planner: str) -> Partition:
    """`part` when every stage fits its cap (recomputing where allowed and needed), else
    PlanError naming the stage and the planners that honour the cap."""
    fitted = cap.evaluate(cost, part.bounds, planner)
    if fitted is not None:
        return fitted
    spans = list(zip((0, *part.bounds[:-1]), part.bounds))
    need = [min(cap.memory(s, a, e, r) for r in cap.modes[s]) for s, (a, e) in enumerate(spans)]
    s = int(np.argmax(np.asarray(need) / cap.limits))
    start, end = spans[s]
    sizes = "+".join(map(str, part.sizes))
    rule = "your stage sizes" if planner == "given" else f"partitioner {planner!r}'s fixed rule"
    raise PlanError(
        f"{rule} ({sizes} units per stage) leaves stage {s} (units {start}-{end - 1}) needing "
        f"{format_bytes(need[s])}, over its memory_limit of {format_bytes(cap.limits[s])}; "
        "use a partitioner that honours the cap: 'balanced', 'exact', 'imd', 'csimd' or 'ampa'")
