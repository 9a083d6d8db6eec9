"""`imd`: CSIMD's improved multi-dimensional dichotomy and its MASP packing (ALGORITHMS §3)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fxpipe.cost import CostTable, Partition
from fxpipe.memory import MemoryBudget
from fxpipe.passes.partition.balanced import settle
from fxpipe.passes.partition.capped import (
    Capacity,
    Timing,
    check_fits,
    split_lanes,
    stage_dp,
    trace_lane,
)
from fxpipe.passes.partition.validate import check_planner_args

__all__ = ["Packing", "imd", "masp", "window_min"]

# Caps are tested with an absolute slack of this fraction of the total volume, so a cap that is
# itself a difference of prefix sums admits the stage it came from despite float rounding.
_SLACK = 1e-12


@dataclasses.dataclass(frozen=True, eq=False)
class Packing:
    """What MASP reads for one cost table at one p: prefix sums, link costs, range-min tables.

    `pack` runs MASP for many cap pairs at once, one numpy lane per pair: that is what makes
    η + 1 weight vectors per bisection step cheap, and `exact` reuses it for its frontier.

    Index e counts units: a stage ending at e holds units [start, e) and its outgoing link is
    the cut after unit e - 1. `link_f[e]`, `link_b[e]` are that cut's forward/backward costs,
    0 at e = K (no link after the last stage) and at e = 0 (a sentinel that stops searches).
    """

    sum_f: np.ndarray  # (K+1,) prefix sums of f
    sum_b: np.ndarray  # (K+1,) prefix sums of b
    link_f: np.ndarray  # (K+1,)
    link_b: np.ndarray  # (K+1,)
    min_f: np.ndarray  # (levels, K+1): min of link_f over the window [e - 2**k + 1, e]
    min_b: np.ndarray  # (levels, K+1)
    tol: float  # absolute slack of every cap test

    @classmethod
    def of(cls, cost: CostTable, p: int = 1) -> Packing:
        f, b, cf, cb = cost.at(p)
        link_f, link_b = np.zeros(cost.units + 1), np.zeros(cost.units + 1)
        link_f[1:-1], link_b[1:-1] = cf[:-1], cb[:-1]
        sum_f = np.concatenate([[0.0], np.cumsum(f)])
        sum_b = np.concatenate([[0.0], np.cumsum(b)])
        volume = sum_f[-1] + sum_b[-1] + link_f.max() + link_b.max()
        return cls(sum_f, sum_b, link_f, link_b, window_min(link_f), window_min(link_b),
                   _SLACK * max(volume, 1e-300))

    @property
    def units(self) -> int:
        return len(self.sum_f) - 1

    def pack(self, v1: np.ndarray, v2: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """MASP for every cap pair (v1[l], v2[l]) at once.

        Returns `counts` (L,), the fewest stages under the caps or 0 when that is more than
        `limit` or some start has no feasible end, and `ends` (L, limit), each row the stage
        ends padded with K. Every stage ends at the furthest unit e such that its f and b sums
        fit the caps and (if e < K) so do the link costs of the cut after it: two binary searches
        in the prefix sums, then a range-min search back past any link that is too expensive.
        """
        cap1 = np.asarray(v1, dtype=np.float64) + self.tol
        cap2 = np.asarray(v2, dtype=np.float64) + self.tol
        units = self.units
        counts = np.zeros(len(cap1), dtype=np.int64)
        ends = np.full((len(cap1), limit), units, dtype=np.int64)
        start = np.zeros(len(cap1), dtype=np.int64)
        live = np.arange(len(cap1))
        for stage in range(limit):
            if live.size == 0:
                break
            first, c1, c2 = start[live], cap1[live], cap2[live]
            end = np.minimum(
                np.searchsorted(self.sum_f, self.sum_f[first] + c1, side="right"),
                np.searchsorted(self.sum_b, self.sum_b[first] + c2, side="right"),
            ) - 1
            end = self._back_to_cheap_link(end, c1, c2)
            moved = end > first
            ends[live[moved], stage] = end[moved]
            counts[live[moved & (end == units)]] = stage + 1
            start[live] = end
            live = live[moved & (end < units)]
        return counts, ends

    def _back_to_cheap_link(self, end: np.ndarray, c1: np.ndarray, c2: np.ndarray) -> np.ndarray:
        """The largest e' <= end whose link fits both caps (e' = 0 when none does)."""
        end = end.copy()
        bad = np.flatnonzero((self.link_f[end] > c1) | (self.link_b[end] > c2))
        while bad.size:
            e, a, b = end[bad], c1[bad], c2[bad]
            e = _last_at_most(self.min_f, e, a)
            e = _last_at_most(self.min_b, e, b)
            end[bad] = e
            bad = bad[(self.link_f[e] > a) | (self.link_b[e] > b)]
        return end

    def scores(self, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ρF, ρB and the link-cost sum Σ(CF + CB) of each row of padded stage ends."""
        starts = np.concatenate([np.zeros((len(ends), 1), np.int64), ends[:, :-1]], axis=1)
        lf, lb = self.link_f[ends], self.link_b[ends]
        rho_f = np.maximum((self.sum_f[ends] - self.sum_f[starts]).max(1), lf.max(1))
        rho_b = np.maximum((self.sum_b[ends] - self.sum_b[starts]).max(1), lb.max(1))
        return rho_f, rho_b, (lf + lb).sum(1)


def window_min(values: np.ndarray) -> np.ndarray:
    """table[k, ..., e] = min(values[..., max(0, e - 2**k + 1) : e + 1]), a sparse table over
    the last axis: any window's minimum is the min of two overlapping entries."""
    levels = max(1, values.shape[-1].bit_length())
    table = np.empty((levels, *values.shape))
    table[0] = values
    for k in range(1, levels):
        half = 1 << (k - 1)
        table[k] = table[k - 1]
        np.minimum(table[k, ..., half:], table[k - 1, ..., :-half], out=table[k, ..., half:])
    return table


def _last_at_most(table: np.ndarray, e: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """The largest e' <= e with values[e'] <= cap, by binary lifting (values[0] = 0 stops it)."""
    for k in range(len(table) - 1, -1, -1):
        e = np.where(table[k, e] > cap, e - (1 << k), e)
    return e


def masp(cost: CostTable, v1: float, v2: float, p: int = 1) -> tuple[int, ...] | None:
    """MASP (CSIMD Alg. 3 with ALGORITHMS §3's fixes): the stage ends of the partition with the
    fewest stages whose stage sums and outgoing links fit the caps (Σf, cf <= v1; Σb, cb <= v2),
    or None when no partition fits. `len()` of the result is the stage count τ.

    Greedy, ending each stage at the *furthest* feasible unit, which is optimal: a later start
    only loosens the sum tests and the link test depends on the end alone. Caps are tested with
    an absolute slack of 1e-12 × (Σf + Σb + largest links), so float rounding never rejects a
    cap that equals a stage's own sum.
    """
    if cost.units == 0:
        raise ValueError("the cost table has no units; build it from at least one unit's costs")
    pack = Packing.of(cost, p)
    counts, ends = pack.pack(np.array([v1]), np.array([v2]), cost.units)
    return tuple(int(e) for e in ends[0, : counts[0]]) if counts[0] else None


def imd(cost: CostTable, stages: int, p: int = 1, eta: int = 1000, eps: float | None = None,
        memory: MemoryBudget | None = None) -> Partition:
    """Minimise ρF + ρB over partitions into at most `stages` stages (CSIMD Alg. 2).

    Bisection on the volume D: D is feasible when some weight vector (j/η, 1 - j/η), j = 0..η,
    splits it into caps MASP can meet with <= N stages. Property 3: the result is within
    OPT·η/(η-1) + ε of the optimum. The returned Partition may have fewer than N stages when
    extra stages only add communication; of all feasible packings met on the way it keeps the
    one with the smallest ρF + ρB (ties: the smaller link-cost sum). Default ε = 1e-4·D_max.

    Under a `memory` cap: exactly N stages (a stage's memory depends on its place among
    them), and D is feasible when some weight's caps admit a partition whose stages also fit
    their memory, recomputing where the budget allows and needs (Σb + Σf): greedy-furthest
    (`capped._reach`), else a DP over (stage, end), as memory is not monotone in a stage's
    end; PlanError when no partition fits at all. When uncapped IMD's partition fits without
    recomputing, the cap changes nothing: that one. Otherwise recomputation makes the step's
    other term vary, T = Σ(f + b) + A + (p − 1)·(ρF + ρB) with A the link costs plus the
    forward time recomputed, so the least T is the objective (ρF + ρB ignores A: more
    stages recomputing for a slightly smaller ρF + ρB can cost more than it saves). The
    candidates are each lane's partitions within its caps, which all meet the bound ρF + ρB
    <= D: at the last feasible D*, each lane's greedy partition and, per lane, the one with
    the least A (a DP over (stage, end)); then each volume D > D* where A(D), the least A over
    the lanes (it falls as D grows), drops, found by bisection to within ε, while (p − 1)·D <
    T − Σ(f + b) of the best so far (a larger D cannot win); at each, that lane's least-A
    partition. The one with the least T. A partition λ that fits lies in some lane at volume
    ρ(λ)·η/(η − 1), so T <= T(λ) + (p − 1)·(ρ(λ)/(η − 1) + ε) for every such λ. A stage
    recomputes only where it does not fit without.
    """
    check_planner_args(cost, stages, p)
    cap = check_fits(cost, stages, p, memory)
    if isinstance(eta, bool) or int(eta) != eta or eta < 2:
        raise ValueError(f"eta={eta!r} must be an integer >= 2 (the paper uses 10, 100, 1000)")
    pack = Packing.of(cost, p)
    f, b = np.diff(pack.sum_f), np.diff(pack.sum_b)
    volume = pack.sum_f[-1] + pack.sum_b[-1]
    d_max = volume + pack.link_f.sum() + pack.link_b.sum()  # ALGORITHMS §3's D_max
    if eps is not None and not eps > 0:
        raise ValueError(f"eps={eps} must be > 0 (the bisection stops when D_max - D_min < eps)")
    eps = 1e-4 * d_max if eps is None else float(eps)
    weights = np.arange(eta + 1) / eta
    if cap is not None:
        free = imd(cost, stages, p, eta, eps)  # when its N stages fit without recomputing,
        fitting = (cap.evaluate(cost, free.bounds, "imd")  # the cap changes nothing
                   if len(free.bounds) == stages else None)
        if fitting is not None and not any(fitting.recompute):
            return settle(cost, fitting, "rho", stages, cap)
        return settle(cost, _capped(cost, cap, pack, weights, stages, eps, d_max), "time",
                      stages, cap)
    lanes = _Lanes(pack, weights, stages)

    d_lo = max(float(f.max()), float(b.max()))
    # With η + 1 weights, one stage holding everything fits some weight once D >= volume·η/(η-1).
    d_hi = max(d_max, volume * eta / (eta - 1))
    best = lanes.best(d_hi) or (np.inf, np.inf, (cost.units,))
    while d_hi - d_lo >= eps:
        d_mid = 0.5 * (d_lo + d_hi)
        if not d_lo < d_mid < d_hi:
            break
        found = lanes.best(d_mid)
        if found is None:
            d_lo = d_mid
        else:
            d_hi = d_mid
            best = min(best, found, key=lambda x: x[:2])
    return settle(cost, Partition.evaluate(cost, best[2], p, "imd"), "rho", stages)


def _capped(cost: CostTable, cap: Capacity, pack: Packing, weights: np.ndarray, stages: int,
            eps: float, d_max: float) -> Partition:
    """IMD's bisection on D under a memory cap: exactly N stages, each within the caps
    (v1, v2) = (wD, (1 − w)D) and its memory cap, links within the caps; then of the lanes'
    partitions at the last feasible D and where the least A drops above it, the least T
    (`imd`'s docstring)."""
    f, b = np.diff(pack.sum_f), np.diff(pack.sum_b)
    again = pack.sum_b + pack.sum_f  # a recomputing stage's backward runs its forward again

    def fitting(volume: float) -> tuple[np.ndarray, np.ndarray]:
        v1, v2 = weights * volume, (1.0 - weights) * volume
        keep = _plausible(pack, v1, v2, stages)
        v1, v2 = v1[keep], v2[keep]
        if not v1.size:
            return v1, v2
        fits = split_lanes(cap, _timings(pack, again, v1, v2), _links_ok(pack, v1, v2))
        return v1[fits], v2[fits]

    adding = _Adding.of(cap, pack, again, weights)

    def feasible(volume: float) -> bool:  # greedy-furthest, else the DP (memory is not
        return bool(fitting(volume)[0].size) or np.isfinite(adding(volume)[0])  # monotone)

    d_lo = max(float(f.max()), float(b.max()))
    d_hi = max(d_max, again[-1] + pack.sum_f[-1]) * len(weights) / max(len(weights) - 2, 1)
    while not feasible(d_hi):  # with the time caps loose enough, some D fits
        d_lo, d_hi = d_hi, 2 * d_hi
    loose, p1 = d_hi, cap.micro_batches - 1
    while d_hi - d_lo >= eps:
        d_mid = 0.5 * (d_lo + d_hi)
        if not d_lo < d_mid < d_hi:
            break
        d_lo, d_hi = (d_lo, d_mid) if feasible(d_mid) else (d_mid, d_hi)
    cut, scored = pack.link_f + pack.link_b, {}

    def score(bounds: tuple[int, ...]) -> Partition:  # the cheapest settings that fit
        if bounds not in scored:
            scored[bounds] = cap.evaluate(cost, bounds, "imd")
        return scored[bounds]

    def cheapest(v1: float, v2: float) -> list[tuple[int, ...]]:
        one, two = np.array([v1]), np.array([v2])
        timings, ok = _timings(pack, again, one, two), _links_ok(pack, one, two)
        found = _cheapest_in_lane(cap, timings, ok, cut, f)
        return [] if found is None else [found[0]]

    # At the last feasible D, each lane's greedy partition and the one adding the least to
    # T = Σ(f + b) + added + (p − 1)·(ρF + ρB) within its caps (added: links, forwards
    # recomputed); the least T of them.
    found = []
    for v1, v2 in zip(*fitting(d_hi)):
        one, two = np.array([v1]), np.array([v2])
        lane = trace_lane(cap, _timings(pack, again, one, two), _links_ok(pack, one, two))
        found += ([lane[0]] if lane else []) + cheapest(v1, v2)
    base = pack.sum_f[-1] + pack.sum_b[-1]
    least, v1, v2 = adding(d_hi)  # the least adding lane's, found by the DP even where
    found += cheapest(v1, v2) if np.isfinite(least) else []  # greedy-furthest finds none
    best = min(map(score, found), key=lambda part: part.predicted_time)
    # Then above d_hi, each volume where the least added over the lanes, A(D), drops (A falls
    # as D grows), while (p − 1)·D < T − Σ(f + b): a larger volume cannot win.
    lo, tiny = d_hi, _SLACK * d_max
    while least > tiny:
        top = loose if p1 == 0 else min(loose, (best.predicted_time - base) / p1)
        if top <= lo or adding(top)[0] >= least - tiny:
            break  # no volume in reach adds less
        hi = top
        while hi - lo >= eps:  # the least volume adding less than `least`, to within eps
            mid = 0.5 * (lo + hi)
            if not lo < mid < hi:
                break
            lo, hi = (lo, mid) if adding(mid)[0] < least - tiny else (mid, hi)
        least, v1, v2 = adding(hi)
        best = min([best, *map(score, cheapest(v1, v2))], key=lambda part: part.predicted_time)
        lo = hi
    return best


@dataclasses.dataclass(frozen=True, eq=False)
class _Adding:
    """A(D): at volume D, the least over the lanes of `_cheapest_in_lane`'s objective (link
    costs plus forward time recomputed; inf when no lane fits) and that lane's caps, by one
    DP over (stage, end) for all lanes at once (in chunks of lanes)."""

    cap: Capacity
    pack: Packing
    weights: np.ndarray
    spans: tuple[np.ndarray, dict[bool, np.ndarray]]  # (K+1, K+1) Σf, and Σb per setting
    base: tuple[dict[bool, np.ndarray], ...]  # per stage and setting: cost, inf: misfit

    @classmethod
    def of(cls, cap: Capacity, pack: Packing, again: np.ndarray, weights: np.ndarray
           ) -> _Adding:
        span_f = pack.sum_f[None, :] - pack.sum_f[:, None]
        span_b = {False: pack.sum_b[None, :] - pack.sum_b[:, None],
                  True: again[None, :] - again[:, None]}
        cut, last = pack.link_f + pack.link_b, cap.stages - 1
        base = tuple({r: np.where(cap.fits(s, r), (0.0 if s == last else cut[None, :])
                                  + (np.maximum(span_f, 0.0) if r else 0.0), np.inf)
                      for r in cap.modes[s]} for s in range(cap.stages))
        return cls(cap, pack, weights, (span_f, span_b), base)

    def __call__(self, volume: float) -> tuple[float, float, float]:
        pack, units, n = self.pack, self.cap.units, self.cap.stages
        v1, v2 = self.weights * volume, (1.0 - self.weights) * volume
        keep = _plausible(pack, v1, v2, n)
        v1, v2 = v1[keep], v2[keep]
        if not v1.size:
            return np.inf, 0.0, 0.0
        values = np.empty(v1.size)
        chunk = max(1, 2_000_000 // (units + 1) ** 2)
        for at in range(0, v1.size, chunk):
            c1 = v1[at:at + chunk, None, None] + pack.tol
            c2 = v2[at:at + chunk, None, None] + pack.tol
            # per setting, 0 where a stage [a, e) fits the lane's time caps, inf where not;
            # a non-last stage's link must fit them too
            last = {r: np.where((self.spans[0] <= c1) & (span <= c2), 0.0, np.inf)
                    for r, span in self.spans[1].items()}
            links = np.where((pack.link_f <= c1[:, 0]) & (pack.link_b <= c2[:, 0]), 0.0, np.inf)
            inner = {r: m + links[:, None, :] for r, m in last.items()}
            best = np.full((len(c1), units + 1), np.inf)
            best[:, 0] = 0.0
            for s, per in enumerate(self.base):
                lane = last if s == n - 1 else inner
                best = np.min([(best[:, :, None] + lane[r] + c).min(axis=1)
                               for r, c in per.items()], axis=0)
            values[at:at + chunk] = best[:, units]
        i = int(np.argmin(values))
        return float(values[i]), float(v1[i]), float(v2[i])


def _cheapest_in_lane(cap: Capacity, timings: Sequence[Timing], ok: np.ndarray | None,
                      cut: np.ndarray, forward: np.ndarray
                      ) -> tuple[tuple[int, ...], tuple[bool, ...]] | None:
    """For one lane (`trace_lane`'s inputs), of the partitions into N stages that fit within
    its time caps (non-last stages ending where `ok`), the one with the least Σ cut[e] over
    the non-last stage ends e plus forward time recomputed; None when none fits."""
    units = np.arange(cap.units + 1)
    fwd = np.concatenate([[0.0], np.cumsum(forward)])
    added = np.maximum(fwd[None, :] - fwd[:, None], 0.0)
    costs = []
    for s in range(cap.stages):
        per = {}
        for r in cap.modes[s]:
            allowed = cap.fits(s, r) & (units[None, :] > units[:, None])
            for t in timings:
                prefix = t.again if r else t.plain
                allowed &= prefix[None, :] - prefix[:, None] <= t.caps[0] + t.tol
            last = s == cap.stages - 1
            if ok is not None and not last:
                allowed &= ok[0][None, :]
            per[r] = np.where(allowed, (0.0 if last else cut[None, :]) + (added if r else 0.0),
                              np.inf)
        costs.append(per)
    value, bounds, settings = stage_dp(cap, costs, np.add)
    return (bounds, settings) if np.isfinite(value) else None


def _plausible(pack: Packing, v1: np.ndarray, v2: np.ndarray, stages: int) -> np.ndarray:
    """Lanes not ruled out unpacked: one whose cap is below the largest unit, or below an
    N-th of the total, cannot fit."""
    slack = 2 * pack.tol
    return ((v1 + slack >= np.diff(pack.sum_f).max()) & (v2 + slack >= np.diff(pack.sum_b).max())
            & (stages * (v1 + slack) >= pack.sum_f[-1])
            & (stages * (v2 + slack) >= pack.sum_b[-1]))


def _timings(pack: Packing, again: np.ndarray, v1: np.ndarray, v2: np.ndarray) -> list[Timing]:
    return [Timing(pack.sum_f, pack.sum_f, v1, pack.tol), Timing(pack.sum_b, again, v2, pack.tol)]


def _links_ok(pack: Packing, v1: np.ndarray, v2: np.ndarray) -> np.ndarray:
    return ((pack.link_f[None, :] <= v1[:, None] + pack.tol)
            & (pack.link_b[None, :] <= v2[:, None] + pack.tol))


@dataclasses.dataclass(frozen=True)
class _Lanes:
    """The weight vectors of one IMD run and the cheap tests that rule lanes out unpacked."""

    pack: Packing
    weights: np.ndarray
    stages: int

    def best(self, volume: float) -> tuple[float, float, tuple[int, ...]] | None:
        """(ρF + ρB, link sum, ends) of the best packing over all weights at `volume`, or None."""
        v1, v2 = self.weights * volume, (1.0 - self.weights) * volume
        n = self.stages
        keep = _plausible(self.pack, v1, v2, n)
        if not keep.any():
            return None
        counts, ends = self.pack.pack(v1[keep], v2[keep], n)
        fits = counts > 0
        if not fits.any():
            return None
        counts, ends = counts[fits], ends[fits]
        rho_f, rho_b, links = self.pack.scores(ends)
        i = np.lexsort((links, rho_f + rho_b))[0]
        bounds = tuple(int(e) for e in ends[i, : counts[i]])
        return float(rho_f[i] + rho_b[i]), float(links[i]), bounds
