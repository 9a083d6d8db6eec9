"""`odpa`: the best micro-batch count for a fixed partition, from one vectorised evaluation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from partition_tables import BATCH, close, p_tables

from fxpipe.cost import CostTable, Partition
from fxpipe.passes.partition import divisors, odpa


@given(p_tables(), st.data())
def test_odpa_picks_the_candidate_with_the_least_time(cost, data):
    cuts = data.draw(st.sets(st.integers(1, cost.units - 1), max_size=3))
    bounds = (*sorted(cuts), cost.units)
    candidates = data.draw(st.lists(st.sampled_from(divisors(BATCH)), min_size=1, unique=True))
    best, times = odpa(cost, bounds, candidates)
    by_hand = [Partition.evaluate(cost, bounds, p).predicted_time for p in candidates]
    assert all(close(a, b) for a, b in zip(times, by_hand))
    assert close(by_hand[candidates.index(best)], min(by_hand))


def test_odpa_finds_an_interior_optimum_of_a_nonlinear_table():
    # 4 one-unit stages, a micro-batch of m samples takes 10 + m: T(p) = (p + 3)(10 + 16/p)
    sizes = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    f = np.repeat((10.0 + sizes)[:, None], 4, axis=1)
    cost = CostTable.from_arrays(f, np.zeros_like(f), sizes=sizes, batch=16)
    best, times = odpa(cost, (1, 2, 3, 4), [1, 2, 4, 8, 16])
    assert best == 2
    np.testing.assert_allclose(times, [104.0, 90.0, 98.0, 132.0, 209.0])


@given(st.integers(1, 5000))
def test_divisors_are_exactly_the_even_splits(batch):
    assert divisors(batch) == [d for d in range(1, batch + 1) if batch % d == 0]


def test_bad_candidates_are_rejected():
    cost = CostTable.from_arrays([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="non-empty"):
        odpa(cost, (1, 2), [])
    with pytest.raises(ValueError, match="positive integers"):
        odpa(cost, (1, 2), [0, 2])
    with pytest.raises(ValueError, match="batch"):
        divisors(0)
