"""Where a recomputing stage's chain of units is cut into checkpointed segments."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np

__all__ = ["RATIO", "Segmentation", "bound_grid", "checkpointed",
           "kept_by_cuts", "kept_by_lifetimes", "kept_bytes", "objective", "recompute_segments",
           "recompute_table", "segment_keeps", "segment_table", "segmentation", "sent_by_lifetimes"]

# a segment's bytes count as the next power of RATIO up (below): the bounds tried are then
# the same for every range of units, so the planners' table for all (start, end) shares them
RATIO = 2.0 ** 0.125


class Segmentation(NamedTuple):
    """A range of units cut into segments: where, and what it holds per micro-batch."""

    cuts: tuple[int, ...]  # the units (of the whole chain) that begin a segment, the first not
    kept: float  # bytes kept at the cuts until the micro-batch's backward
    largest: float  # bytes the largest segment saves: what its recompute holds again


def kept_by_lifetimes(lifetimes: np.ndarray) -> np.ndarray:
    """(K+1, K+1) `out` for `segmentation` from (K, K) lifetimes[m, r], the bytes of the values
    unit m makes and unit r reads last: out[i, j], what a segment of the units [i, j) keeps
    at a cut before unit j, its values that a unit from j on reads. Each value is kept once,
    by the segment that makes it, however many cuts it crosses."""
    lifetimes = np.asarray(lifetimes, dtype=np.float64)
    units = len(lifetimes)
    later = np.zeros((units + 1, units + 1))  # [m, j]: made by m, read from unit j on
    later[:units, :units] = np.cumsum(lifetimes[:, ::-1], axis=1)[:, ::-1]
    made = np.cumsum(later[::-1], axis=0)[::-1]  # [i, j]: made from unit i on, read from j on
    out = np.triu(made - np.diag(made)[None, :], 1)
    out[:, units] = 0.0  # the chain's end is no cut
    return out


def sent_by_lifetimes(lifetimes: np.ndarray) -> np.ndarray:
    """(K+1, K+1) `sent` for `segmentation` from (K, K) lifetimes (`kept_by_lifetimes`):
    sent[i, e], the bytes of the values units from i on make and units from e on read. A
    stage [a, e) sends those it makes that later units read, and holds them anyway: of what
    its cuts keep, the values made before its last cut c, sent[a, e] - sent[c, e]."""
    lifetimes = np.asarray(lifetimes, dtype=np.float64)
    units = len(lifetimes)
    later = np.zeros((units + 1, units + 1))
    later[:units, :units] = np.cumsum(lifetimes[:, ::-1], axis=1)[:, ::-1]
    return np.cumsum(later[::-1], axis=0)[::-1]


def kept_by_cuts(kept: np.ndarray) -> np.ndarray:
    """(K+1, K+1) `out` for `segmentation` from the bytes live across each cut between
    units (K - 1 of them) where who made them is not known: a segment ending at a cut keeps
    all of them (a value crossing several cuts counts at each)."""
    kept = np.asarray(kept, dtype=np.float64)
    units = len(kept) + 1
    out = np.zeros((units + 1, units + 1))
    out[:, 1:units] = kept[None, :]
    return np.triu(out, 1)


def bound_grid(saved: np.ndarray) -> np.ndarray:
    """The bounds on a segment's bytes tried: 0 and the powers of RATIO from the smallest
    positive unit's bytes (rounded down) to the total's (rounded up)."""
    saved = np.asarray(saved, dtype=np.float64)
    positive = saved[saved > 0]
    if not positive.size:
        return np.zeros(1)
    low = math.floor(math.log(float(positive.min()), RATIO))
    high = math.ceil(math.log(float(saved.sum()), RATIO))
    return np.concatenate([[0.0], RATIO ** np.arange(low, high + 1, dtype=np.float64)])


def kept_bytes(out: np.ndarray, sent: np.ndarray | None, start: int, end: int,
               cuts: tuple[int, ...]) -> float:
    """What the cuts of [start, end) keep: out[i, j] for each segment [i, j) ending at a
    cut, less the values of them the stage sends (`sent_by_lifetimes`)."""
    edges = [start, *cuts]
    kept = float(sum(out[a, b] for a, b in zip(edges, cuts)))
    return kept if sent is None else kept - (sent[start, end] - sent[edges[-1], end])


def objective(out: np.ndarray, saved: np.ndarray, start: int, end: int,
              cuts: tuple[int, ...], sent: np.ndarray | None = None) -> float:
    """What the cuts cost the range [start, end): the bytes they keep (`kept_bytes`), plus
    the largest segment's bytes rounded up to the next bound of `bound_grid(saved)`."""
    edges = [start, *cuts, end]
    largest = max(float(np.sum(saved[a:b])) for a, b in zip(edges, edges[1:]))
    grid = bound_grid(saved)
    over = grid[grid >= largest * (1 - 1e-12)]
    return kept_bytes(out, sent, start, end, cuts) + float(over[0])


class _Paths(NamedTuple):
    """Per start (rows) and unit j: the least kept bytes of [start, j) cut into segments
    under a bound, with j a cut (`cut`: what the segment ending there keeps counted) or the
    end (`end`); the largest segment of those cuts; where the last segment begins."""

    cut: np.ndarray
    cut_largest: np.ndarray
    cut_back: np.ndarray
    end: np.ndarray
    end_largest: np.ndarray
    end_back: np.ndarray


def _solve(out: np.ndarray, sent: np.ndarray, saved: np.ndarray, starts: np.ndarray,
           bounds: np.ndarray, last: int) -> _Paths:
    """`_Paths` for the units j <= `last` for rows of ascending `starts`, each row's segments
    of at most its bound: `bounds` one for every row, or one per row (a start under several
    bounds at once: each row then tries the units a wider bound fits as if they were not)."""
    units = len(saved)
    prefix = np.concatenate([[0.0], np.cumsum(saved)])
    count = len(starts)
    shape = (count, units + 1)
    paths = _Paths(np.full(shape, np.inf), np.zeros(shape), np.zeros(shape, dtype=np.int64),
                   np.full(shape, np.inf), np.zeros(shape), np.zeros(shape, dtype=np.int64))
    paths.cut[np.arange(count), starts] = 0.0
    bounds = np.asarray(bounds, dtype=np.float64)
    shared = len(bounds) == 1
    for j in range(int(starts.min()) + 1, last + 1):
        rows = int(np.searchsorted(starts, j))  # the rows of the starts before j, a prefix
        span = prefix[j] - prefix[:j]  # bytes of the segment [i, j), i < j
        fits = span[None, :] <= (bounds if shared else bounds[:rows])[:, None]
        firsts = np.where(fits.any(axis=1), fits.argmax(axis=1), j)
        first = int(firsts.min())  # each row's fitting spans (they shrink with i): a suffix
        if first == j:
            continue
        index = np.arange(rows)
        before = paths.cut[:rows, first:j]  # [a, i]: inf where i < a
        if not shared:  # a row's own window: the units it fits
            before = np.where(np.arange(first, j)[None, :] < firsts[:, None], np.inf, before)
        # ending there: of the values kept, those made before the last cut and read from j
        # on are the stage's outputs, held anyway
        sends = sent[first:j, j][None, :] - sent[starts[:rows], j][:, None]
        for options, value, largest, back in (
                (before + sends, paths.end, paths.end_largest, paths.end_back),
                (before + out[first:j, j][None, :], paths.cut, paths.cut_largest,
                 paths.cut_back)):
            pick = np.argmin(options, axis=1)
            # where nothing fits (inf), what a row's own window would pick: its first unit
            begin = (first + pick if shared else
                     np.maximum(first + pick, np.minimum(firsts, j - 1)))
            found = (options[index, pick], np.maximum(paths.cut_largest[index, begin],
                                                      span[begin]), begin)
            if shared:
                value[:rows, j], largest[:rows, j], back[:rows, j] = found
            else:  # a row none of whose units fits keeps its column as it is
                keep = firsts < j
                for array, new in zip((value, largest, back), found):
                    array[:rows, j] = np.where(keep, new, array[:rows, j])
    return paths


def segment_table(out: np.ndarray, saved: np.ndarray, sent: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(K+1, K+1) per range of units [a, e): the kept bytes and the largest segment's bytes
    of `segmentation(out, saved, a, e, sent)` (0 where e <= a). O(M·K²·w) for M bounds and
    segments of at most w units."""
    saved = np.asarray(saved, dtype=np.float64)
    sent = np.zeros((len(saved) + 1,) * 2) if sent is None else np.asarray(sent, np.float64)
    units = len(saved)
    starts = np.arange(units + 1)
    best = np.full((units + 1, units + 1), np.inf)
    table_kept, table_largest = np.zeros_like(best), np.zeros_like(best)
    grid = bound_grid(saved)
    # a bound at least every range from a start holds (the one before it too) cannot do
    # better there than that one did: its range need no cut under either, and it is larger
    total = np.concatenate([[0.0], np.cumsum(saved)])
    total = total[-1] - total
    monotone = bool(np.all(saved >= 0))  # the spans then grow with the range
    for k, bound in enumerate(grid):
        rows = units + 1
        if monotone and k:
            rows = int(np.flatnonzero(np.append(True, total > grid[k - 1]))[-1])
        if not rows:
            break  # every later bound holds every range too
        paths = _solve(out, sent, saved, starts[:rows], np.array([bound]), units)
        value = bound + paths.end
        better = value < best[:rows]  # ties: the smaller bound, tried first
        best[:rows] = np.where(better, value, best[:rows])
        table_kept[:rows] = np.where(better, paths.end, table_kept[:rows])
        table_largest[:rows] = np.where(better, paths.end_largest, table_largest[:rows])
    empty = starts[None, :] <= starts[:, None]
    table_kept[empty] = 0.0
    table_largest[empty] = 0.0
    return table_kept, table_largest


def segmentation(out: np.ndarray, saved: np.ndarray, start: int = 0,
                 end: int | None = None, sent: np.ndarray | None = None) -> Segmentation:
    """The cuts of the units [start, end) of a chain (`saved`: each unit's bytes saved for
    its backward; `out`: (K+1, K+1), what a segment [i, j) keeps at a cut before unit j,
    `kept_by_lifetimes` or `kept_by_cuts`; `sent`: `sent_by_lifetimes`, or None) that cost
    the least by `objective`: the bytes a micro-batch keeps at the cuts plus, once, the
    largest segment's recomputed bytes. Exact for that objective (the least over bounds of
    the bound plus the least kept bytes under it); `segment_table` holds its figures for
    every range."""
    saved = np.asarray(saved, dtype=np.float64)
    out = np.asarray(out, dtype=np.float64)
    sent = np.zeros(out.shape) if sent is None else np.asarray(sent, dtype=np.float64)
    end = len(saved) if end is None else end
    if out.shape != (len(saved) + 1,) * 2:
        raise ValueError(f"out has shape {out.shape} for {len(saved)} units: give "
                         f"{(len(saved) + 1,) * 2}, one row and column per cut")
    if not 0 <= start < end <= len(saved):
        raise ValueError(f"units [{start}, {end}) are not a range of the {len(saved)} units")
    grid = bound_grid(saved)
    # the bounds that matter here: from the largest unit's (below it nothing fits) to the
    # first at least the range's total (above it, no cut is needed either)
    total = float(np.sum(saved[start:end]))
    low = int(np.searchsorted(grid, float(np.max(saved[start:end])) * (1 - 1e-9)))
    high = int(np.searchsorted(grid, total * (1 + 1e-9)))
    bounds = grid[max(low - 1, 0):high + 1]
    paths = _solve(out, sent, saved, np.full(len(bounds), start), bounds, end)  # all at once
    best, row = np.inf, None
    for k, bound in enumerate(bounds):
        if bound + paths.end[k, end] < best:
            best, row = bound + paths.end[k, end], k
    cuts, j = [], int(paths.end_back[row, end])
    while j > start:
        cuts.append(j)
        j = int(paths.cut_back[row, j])
    return Segmentation(tuple(reversed(cuts)), float(paths.end[row, end]),
                        float(paths.end_largest[row, end]))


def checkpointed(out: np.ndarray, per_checkpoint: float) -> np.ndarray:
    """`out` with `per_checkpoint` bytes added at each cut (it begins one more checkpoint)."""
    out = np.array(out, dtype=np.float64)
    out[:, :-1] += np.triu(np.full((len(out), len(out) - 1), float(per_checkpoint)), 1)
    return out


def segment_keeps(cost: Any, p: int) -> tuple[np.ndarray, np.ndarray | None]:
    """For a cost table at count p, per micro-batch: `out` and `sent` for `segmentation`
    from its values' lifetimes, or where those were not measured, from the bytes crossing
    each cut (and no `sent`)."""
    lifetimes = cost.lifetimes(p)
    if lifetimes is None:
        return kept_by_cuts(cost.crossing_bytes(p)[0][:-1]), None
    return kept_by_lifetimes(lifetimes), sent_by_lifetimes(lifetimes)


class _Prepared(NamedTuple):
    """A cost table's inputs to `segmentation` at one count, and what was found from them."""

    out: np.ndarray  # `checkpointed` `segment_keeps` out
    sent: np.ndarray | None
    saved: np.ndarray
    per: float  # checkpoint_bytes
    found: dict  # (start, end) -> Segmentation; "table" -> recompute_table's arrays


# The planners ask for the same table's segments at the same count many times (a cap's
# least scale, its Capacity, each planner's own check, every partition scored), each
# O(M·K²·w): kept here by the bytes of their inputs (not the table's identity, which a
# later table may reuse), the most recently used few within a byte budget. A pure cache:
# what it returns is what computing again would (read-only arrays, so no caller can change
# what it holds).
_CACHED = 8
_CACHED_BYTES = 64 * 2**20  # its keys, inputs and tables (5 (K+1)² arrays a count); the
# most recent entry stays whatever its size: both calls for one count share it
_RANGES = 4096  # ranges' segmentations kept per table and count
_cache: OrderedDict[tuple, _Prepared] = OrderedDict()
_lock = threading.Lock()


def _prepared(cost: Any, p: int) -> _Prepared:
    """The inputs of `recompute_segments` and `recompute_table` for `cost` at count p, and
    the cache of what was found from them."""
    per = float(cost.checkpoint_bytes)
    saved = np.ascontiguousarray(cost.saved_bytes(p), dtype=np.float64)
    lifetimes = cost.lifetimes(p)
    source = np.ascontiguousarray(cost.crossing_bytes(p)[0][:-1] if lifetimes is None
                                  else lifetimes, dtype=np.float64)
    key = (lifetimes is None, np.float64(per).tobytes(), saved.shape, saved.tobytes(),
           source.shape, source.tobytes())
    with _lock:
        entry = _cache.get(key)
        if entry is not None:
            _cache.move_to_end(key)
            return entry
    if lifetimes is None:
        out, sent = kept_by_cuts(source), None
    else:
        out, sent = kept_by_lifetimes(source), sent_by_lifetimes(source)
    entry = _Prepared(_frozen(checkpointed(out, per)), None if sent is None else _frozen(sent),
                      _frozen(saved), per, {})
    with _lock:
        entry = _cache.setdefault(key, entry)
        _cache.move_to_end(key)
        while len(_cache) > 1 and (len(_cache) > _CACHED or
                                   sum(map(_size, _cache.items())) > _CACHED_BYTES):
            _cache.popitem(last=False)
    return entry


def _size(item: tuple[tuple, _Prepared]) -> int:
    """The bytes a cache entry holds, its table counted before it is made."""
    key, entry = item
    return len(key[3]) + len(key[5]) + 4 * entry.out.nbytes


def _frozen(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def recompute_segments(cost: Any, p: int, start: int, end: int) -> Segmentation:
    """How a stage of a cost table (`cost`) over the units [start, end) that recomputes is
    cut into checkpointed segments at count p (`segmentation`): from each unit's saved bytes
    and what each segment keeps at its cut (`segment_keeps`), with the table's
    `checkpoint_bytes` per checkpoint and one more for the stage's replay record."""
    entry = _prepared(cost, p)
    found = entry.found.get((start, end))
    if found is None:
        found = segmentation(entry.out, entry.saved, start, end, entry.sent)
        found = found._replace(kept=found.kept + 2 * entry.per)
        if len(entry.found) < _RANGES:
            entry.found[(start, end)] = found
    return found


def recompute_table(cost: Any, p: int) -> tuple[np.ndarray, np.ndarray]:
    """(K+1, K+1) per range [a, e): `recompute_segments`' kept and largest bytes (read-only)."""
    entry = _prepared(cost, p)
    found = entry.found.get("table")
    if found is None:
        kept, largest = segment_table(entry.out, entry.saved, entry.sent)
        units = np.arange(len(kept))
        kept = np.where(units[None, :] > units[:, None], kept + 2 * entry.per, 0.0)
        found = entry.found.setdefault("table", (_frozen(kept), _frozen(largest)))
    return found
