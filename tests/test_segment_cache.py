"""The segments' fast paths change no bit: the solver batched over starts and bounds is the
plain dynamic programme, and the cache of a table's segments returns what computing does."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from segment_chains import chains

from fxpipe import segments
from fxpipe.cost import CostTable
from fxpipe.segments import (
    bound_grid,
    checkpointed,
    kept_by_cuts,
    kept_by_lifetimes,
    recompute_segments,
    recompute_table,
    segment_table,
    segmentation,
    sent_by_lifetimes,
)


def plain_paths(out, sent, saved, start, bound):
    """One start, one bound, one unit at a time: per unit j, (kept, largest, back) with j a
    cut and with j the end, each the first least over the segments' starts that fit."""
    sent = np.zeros(out.shape) if sent is None else sent
    prefix = np.concatenate([[0.0], np.cumsum(saved)])
    inf = (np.inf, 0.0, 0)
    cut, end = {start: (0.0, 0.0, start)}, {}
    for j in range(start + 1, len(saved) + 1):
        span = prefix[j] - prefix[:j]
        fits = np.flatnonzero(span <= bound)
        if not fits.size:
            continue
        for paths, extra in ((end, sent[:j, j] - sent[start, j]), (cut, out[:j, j])):
            best, begin = np.inf, int(fits[0])
            for i in range(int(fits[0]), j):
                value = cut.get(i, inf)[0] + extra[i]
                if value < best:
                    best, begin = value, i
            paths[j] = (best, max(cut.get(begin, inf)[1], span[begin]), begin)
    return cut, end


def plain_segmentation(out, sent, saved, start, stop, bounds):
    """The first bound (of `bounds`, in order) least in bound + kept, and its cuts."""
    best, chosen = np.inf, None
    for bound in bounds:
        cut, end = plain_paths(out, sent, saved, start, bound)
        kept, largest, back = end.get(stop, (np.inf, 0.0, 0))
        if bound + kept < best:
            best, chosen = bound + kept, (kept, largest, back, cut)
    kept, largest, j, cut = chosen
    cuts = []
    while j > start:
        cuts.append(j)
        j = cut[j][2]
    return tuple(reversed(cuts)), kept, largest


@settings(max_examples=25, deadline=None)
@given(chains(most=6), st.sampled_from([0.0, 3.0]))
def test_the_table_and_every_segmentation_are_the_plain_programmes_to_the_bit(chain, per):
    out, sent, saved, _, _ = chain  # every range of the chain
    out = checkpointed(out, per)
    grid = bound_grid(saved)
    kept, largest = segment_table(out, saved, sent)
    for a in range(len(saved)):
        for e in range(a + 1, len(saved) + 1):
            _, k, g = plain_segmentation(out, sent, saved, a, e, grid)
            assert (kept[a, e], largest[a, e]) == (k, g)
            found = segmentation(out, saved, a, e, sent)
            # segmentation tries only the bounds that can matter: the same answer
            assert found == plain_segmentation(out, sent, saved, a, e, grid)


def table(rng: np.random.Generator, units: int, lifetimes: bool) -> CostTable:
    cost = CostTable.from_arrays(np.ones(units), np.ones(units),
                                 activation_bytes=rng.uniform(1, 50, units),
                                 boundary_bytes=rng.uniform(1, 20, units))
    if not lifetimes:
        return cost
    made = np.triu(rng.uniform(0, 30, (units, units)) * (rng.uniform(size=(units, units)) < .3), 1)
    return dataclasses.replace(cost, lifetime_bytes=made[None], checkpoint_bytes=3.0)


def uncached(cost: CostTable, p: int) -> tuple[np.ndarray, np.ndarray]:
    """What `recompute_table` computes, from the table's own arrays."""
    per = cost.checkpoint_bytes
    lifetimes = cost.lifetimes(p)
    out, sent = ((kept_by_cuts(cost.crossing_bytes(p)[0][:-1]), None) if lifetimes is None
                 else (kept_by_lifetimes(lifetimes), sent_by_lifetimes(lifetimes)))
    kept, largest = segment_table(checkpointed(out, per), cost.saved_bytes(p), sent)
    units = np.arange(len(kept))
    return np.where(units[None, :] > units[:, None], kept + 2 * per, 0.0), largest


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 12), st.booleans())
def test_the_cached_segments_are_what_computing_them_again_gives(seed, units, lifetimes):
    rng = np.random.default_rng(seed)
    cost = table(rng, units, lifetimes)
    expected = uncached(cost, 1)
    for _ in range(2):  # computed, then from the cache
        kept, largest = recompute_table(cost, 1)
        assert np.array_equal(kept, expected[0]) and np.array_equal(largest, expected[1])
        assert not kept.flags.writeable and not largest.flags.writeable
        for a in range(units):
            for e in range(a + 1, units + 1):
                found = recompute_segments(cost, 1, a, e)
                assert (found.kept, found.largest) == (kept[a, e], largest[a, e])
    # a table changed in place is a new table, not the one cached before
    cost.activation_bytes[0, 0] += 100.0
    changed = uncached(cost, 1)
    assert np.array_equal(recompute_table(cost, 1)[0], changed[0])
    assert recompute_segments(cost, 1, 0, units).largest == changed[1][0, units]


def test_the_cache_holds_a_few_tables_within_its_bytes(monkeypatch):
    rng = np.random.default_rng(0)
    costs = [table(rng, 6, True) for _ in range(segments._CACHED + 3)]
    for cost in costs:
        recompute_table(cost, 1)
    assert len(segments._cache) == segments._CACHED  # the least recently used went
    monkeypatch.setattr(segments, "_CACHED_BYTES", 1)
    recompute_table(costs[0], 1)
    assert len(segments._cache) == 1  # the one asked for stays, however large
    assert np.array_equal(recompute_table(costs[0], 1)[0], uncached(costs[0], 1)[0])
