"""Memory caps for the planners: which stages fit, splits under caps, the smallest cap that fits."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fxpipe.cost import CostTable, Partition
from fxpipe.errors import PlanError
from fxpipe.memory import MemoryBudget
from fxpipe.passes.partition.odpa import divisors

__all__ = ["Capacity", "Timing", "capacities", "capped_minmax", "check_fits", "fit_or_explain",
           "split_lanes", "trace_lane"]

_SLACK = 1e-9  # relative: a stage exactly at its cap (up to float rounding) fits
_DENSE_UNITS = 1500  # least_recomputed's (K+1)² tables per stage stay below ~40 MB


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
    """Each stage's memory in an N-stage pipeline at p micro-batches, as prefix sums over the
    units: stage s on units [a, e) holds fixed[s, e] - fixed[s, a] without recomputation, and
    once[s, e] - once[s, a] + entry[s, a] with it (its inputs per micro-batch in flight, and
    one micro-batch's activations while it recomputes)."""

    limits: np.ndarray  # (N,) bytes
    modes: tuple[tuple[bool, ...], ...]  # per stage: the recompute settings allowed
    fixed: np.ndarray  # (N, K+1)
    once: np.ndarray  # (N, K+1)
    entry: np.ndarray  # (N, K+1)
    held: tuple[int, ...]
    micro_batches: int
    budget: MemoryBudget

    @classmethod
    def of(cls, cost: CostTable, stages: int, p: int, budget: MemoryBudget) -> Capacity:
        held = np.asarray(budget.held(stages, p), dtype=np.float64)
        kept = (2.0 + budget.optimizer_slots) * cost.param_bytes  # weights, grads, slots
        saved = cost.saved_bytes(p)
        fixed = _prefix(kept[None, :] + held[:, None] * saved[None, :])
        once = _prefix(np.broadcast_to(kept + saved, (stages, cost.units)))
        entry = held[:, None] * cost.input_bytes(p)[None, :]
        return cls(budget.limits(stages), budget.modes(stages), fixed, once, entry,
                   tuple(int(h) for h in held), p, budget)

    @property
    def stages(self) -> int:
        return len(self.limits)

    @property
    def units(self) -> int:
        return self.fixed.shape[1] - 1

    def memory(self, s: int, start: int, end: int, recompute: bool) -> float:
        if recompute:
            return float(self.once[s, end] - self.once[s, start] + self.entry[s, start])
        return float(self.fixed[s, end] - self.fixed[s, start])

    def far(self, s: int, recompute: bool, scale: float = 1.0) -> np.ndarray:
        """(K+1,) per start unit, the furthest end of stage s within its cap × scale."""
        cap = self.limits[s] * scale * (1 + _SLACK)
        prefix = self.once[s] if recompute else self.fixed[s]
        target = prefix + cap - (self.entry[s] if recompute else 0.0)
        ends = np.searchsorted(prefix, target, side="right") - 1
        return np.maximum(ends, np.arange(self.units + 1))

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


def _prefix(rows: np.ndarray) -> np.ndarray:
    """Prefix sums of each row, with a leading 0."""
    return np.concatenate([np.zeros((rows.shape[0], 1)), np.cumsum(rows, axis=1)], axis=1)


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


def capped_minmax(cap: Capacity, weights: np.ndarray, again: np.ndarray | None = None,
                  forward: np.ndarray | None = None
                  ) -> tuple[tuple[int, ...], tuple[bool, ...]] | None:
    """The partition into exactly N stages that fit whose largest stage sum of `weights`
    (`again` for a recomputing stage) is the least, by bisection on the float caps; None when
    none fits. With `forward` (per-unit times), of those the one recomputing the least
    forward time (what recomputation adds to a step), for up to _DENSE_UNITS units."""
    plain = np.concatenate([[0.0], np.cumsum(weights)])
    twice = plain if again is None else np.concatenate([[0.0], np.cumsum(again)])
    tol = 1e-12 * max(float(twice[-1]), 1e-300)
    timing = lambda v: [Timing(plain, twice, np.array([v]), tol)]  # noqa: E731
    lo, hi = 0.0, float(max(plain[-1], twice[-1]))
    if not split_lanes(cap, timing(hi))[0]:
        return None
    if not split_lanes(cap, timing(lo))[0]:
        while True:
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:
                break
            if split_lanes(cap, timing(mid))[0]:
                hi = mid
            else:
                lo = mid
    else:
        hi = lo
    found = trace_lane(cap, timing(hi))
    if forward is not None and any(found[1]) and cap.units <= _DENSE_UNITS:
        return least_recomputed(cap, timing(hi), np.concatenate([[0.0], np.cumsum(forward)]))
    return found


def least_recomputed(cap: Capacity, timings: Sequence[Timing], forward: np.ndarray
                     ) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """For one lane that admits a partition, the one whose recomputing stages' forward sums
    (`forward`: prefix sums) add the least: a DP over (stage, end), each stage plain or
    recomputing wherever it fits, O(N·K²)."""
    units = cap.units
    start, end = np.arange(units + 1)[:, None], np.arange(units + 1)[None, :]
    best = np.full(units + 1, np.inf)
    best[0] = 0.0
    steps = []
    for s in range(cap.stages):
        far = _lane_far(cap, s, timings, 1, 1.0)[:, 0, :]  # (modes, K+1)
        options = []
        for m, rc in enumerate(cap.modes[s]):
            added = (forward[None, :] - forward[:, None]) if rc else 0.0
            options.append(np.where((end > start) & (end <= far[m][:, None]),
                                    best[:, None] + added, np.inf))
        stacked = np.stack(options)  # (modes, start, end)
        flat = stacked.reshape(-1, units + 1).argmin(axis=0)
        steps.append((flat // (units + 1), flat % (units + 1)))  # mode, start per end
        best = stacked.reshape(-1, units + 1).min(axis=0)
    bounds, again, e = [], [], units
    for s in range(cap.stages - 1, -1, -1):
        mode, first = steps[s]
        bounds.append(e)
        again.append(cap.modes[s][int(mode[e])])
        e = int(first[e])
    return tuple(reversed(bounds)), tuple(reversed(again))


def smallest_scale(cap: Capacity) -> tuple[float, tuple[int, ...], tuple[bool, ...]]:
    """The least s such that every cap × s admits a partition, and that partition."""
    # every range fits a stage holding at most this much (recomputing: plus its largest input)
    most = [min(float(cap.once[s, -1] + cap.entry[s].max()) if r else float(cap.fixed[s, -1])
                for r in cap.modes[s]) / cap.limits[s] for s in range(cap.stages)]
    lo, hi = 0.0, max(max(most), 1e-300) * (1 + 4 * _SLACK)
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        if split_lanes(cap, [], scale=mid)[0]:
            hi = mid
        else:
            lo = mid
    bounds, again = trace_lane(cap, [], scale=hi)
    return cap.ratio(bounds, again)[0], bounds, again


def check_fits(cost: CostTable, stages: int, p: int, budget: MemoryBudget | None
               ) -> Capacity | None:
    """The Capacity to plan under, None without a cap; PlanError, before any search, when no
    partition into `stages` fits at p micro-batches (naming the smallest cap that would)."""
    if budget is None or not budget.capped:
        return None
    cap = Capacity.of(cost, stages, p, budget)
    scale, bounds, again = smallest_scale(cap)
    if scale <= 1 + _SLACK:
        return cap
    message = _explain(cap, budget, scale, bounds, again)
    if cost.batch is not None and len(cost.sizes) > 1:  # measured at several micro-batch
        # sizes, so another count may fit where this one does not
        others = [q for q in divisors(cost.batch) if q != p and
                  smallest_scale(Capacity.of(cost, stages, q, budget))[0] <= 1 + _SLACK]
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
        cap = Capacity.of(cost, stages, q, budget)
        scale, bounds, again = smallest_scale(cap)
        if scale <= 1 + _SLACK:
            found[q] = cap
        elif least is None or scale < least[0]:
            least = (scale, cap, bounds, again)
    if not found:
        scale, cap, bounds, again = least
        raise PlanError(_explain(cap, budget, scale, bounds, again, every_count=True)
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
        f"{_bytes(need[s])}, over its memory_limit of {_bytes(cap.limits[s])}; use a "
        "partitioner that honours the cap: 'balanced', 'exact', 'imd', 'csimd' or 'ampa'")


def _explain(cap: Capacity, budget: MemoryBudget, scale: float, bounds: tuple[int, ...],
             again: tuple[bool, ...], every_count: bool = False) -> str:
    s = cap.ratio(bounds, again)[1]
    start, end = (0, *bounds)[s], bounds[s]
    needed = [int(np.ceil(x * scale)) if np.isfinite(x) else None for x in cap.limits]
    limit = (f"{needed[0]} bytes" if len(set(needed)) == 1 else
             "[" + ", ".join(str(x) for x in needed) + "] bytes (per stage)")
    held = cap.held[s]
    how = (f"recomputing, so its inputs × {held} micro-batches in flight" if again[s] else
           f"its activations × {held} micro-batches in flight")
    hint = ""
    if not budget.recompute:
        hint = ", recompute='auto' (recomputes the forward of the stages that need it)"
    return (f"no partition into {cap.stages} stages fits the memory cap ({_bytes(cap.limits[s])} "
            f"on stage {s}) at {cap.micro_batches} micro-batch(es): the partition needing the "
            f"least ({'+'.join(str(e - a) for a, e in zip((0, *bounds), bounds))} units) still "
            f"needs {_bytes(cap.memory(s, start, end, again[s]))} on stage {s} (units "
            f"{start}-{end - 1}: weights, gradients, optimizer state and {how}); give "
            f"memory_limit={limit} ({_bytes(max(x for x in needed if x))}) or more, "
            f"more stages{hint}"
            + ("" if every_count else
               ", or more micro-batches (smaller ones hold fewer activation bytes)"))


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
