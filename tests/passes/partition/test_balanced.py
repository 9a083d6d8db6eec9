"""`balanced` and its min-max helper: the optimum of the largest stage sum, by brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from partition_tables import close, costs, instances

from fxpipe.passes.partition import balanced, brute_force, minmax_bounds


def _brute_minmax(weights: list[float], stages: int) -> float:
    units = len(weights)
    best = np.inf
    for cuts in itertools.combinations(range(1, units), stages - 1):
        edges = (0, *cuts, units)
        best = min(best, max(sum(weights[a:b]) for a, b in zip(edges, edges[1:])))
    return best


@given(st.lists(costs, min_size=1, max_size=10), st.data())
def test_minmax_bounds_reach_the_brute_force_optimum_with_exactly_n_stages(weights, data):
    stages = data.draw(st.integers(1, len(weights)))
    bounds = minmax_bounds(weights, stages)
    assert len(bounds) == stages and bounds[-1] == len(weights)
    edges = (0, *bounds)
    assert all(a < b for a, b in zip(edges, edges[1:]))
    worst = max(sum(weights[a:b]) for a, b in zip(edges, edges[1:]))
    assert close(worst, _brute_minmax(weights, stages))


@given(instances())
def test_balanced_minimises_the_largest_stage_compute_time(instance):
    cost, stages, p = instance
    part = balanced(cost, stages, p)
    best = brute_force(cost, stages, p, objective="compute")
    assert close(max(s.f + s.b for s in part.stages), max(s.f + s.b for s in best.stages))


def test_minmax_on_a_hand_worked_example():
    # 1..9 into 3: the last stage holds 9; [9] alone leaves 36 for two stages (max >= 18), so
    # [8 9] = 17 is the best last stage, and [1..5] = 15, [6 7] = 13 fit under it.
    assert minmax_bounds(list(range(1, 10)), 3) == (5, 7, 9)


def test_minmax_rejects_impossible_splits():
    with pytest.raises(ValueError, match="cannot split 2 weights into 3"):
        minmax_bounds([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="non-negative"):
        minmax_bounds([1.0, -2.0], 1)
