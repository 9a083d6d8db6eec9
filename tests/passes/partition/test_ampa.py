"""`ampa`: GroPipe's dispersion-driven shifting, with the guards ALGORITHMS §2 adds."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from partition_tables import instances

from fxpipe.cost import CostTable
from fxpipe.passes.partition import ampa, even
from fxpipe.passes.partition.ampa import dispersion


def _max_stage(part):
    return max(s.f + s.b for s in part.stages)


@given(instances(max_units=12, max_stages=5), st.booleans(), st.sampled_from([0.0, 0.05, 0.3]))
def test_ampa_is_never_worse_than_the_even_split(instance, normalize, threshold):
    cost, stages, p = instance
    part = ampa(cost, stages, p, normalize=normalize, threshold=threshold)
    assert len(part.bounds) == stages  # no stage was emptied
    split = even(cost, stages, p)
    assert _max_stage(part) <= _max_stage(split)
    assert part.predicted_time <= split.predicted_time  # links and p included


def test_ampa_moves_units_from_the_slowest_toward_the_fastest_stage():
    # even: [9 9] [1 1] [1 1] -> max stage 0 gives its last unit to min stage 1: [9] [9 1 1] [1 1]
    # -> stage 1 gives to stage 2: [9] [9 1] [1 1 1] -> again: [9] [9] [1 1 1 1], max 9; then the
    # slowest stage is a single unit and cannot shrink, so AMPA stops there (the optimum).
    cost = CostTable.from_arrays([9.0, 9.0, 1.0, 1.0, 1.0, 1.0], [0.0] * 6)
    assert ampa(cost, 3).bounds == (1, 2, 6)


def test_ampa_with_no_rounds_or_a_loose_threshold_is_the_even_split():
    # at p = 2, where the even split is slower than the balanced one (at p = 1 every split
    # ties on T, and a tie goes to the balanced split)
    cost = CostTable.from_arrays([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], [5.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert ampa(cost, 2, 2, max_rounds=0).bounds == even(cost, 2).bounds
    assert ampa(cost, 2, 2, threshold=10.0).bounds == even(cost, 2).bounds
    assert ampa(cost, 2, 2).bounds != even(cost, 2).bounds


def test_dispersion_is_the_mean_absolute_deviation_over_the_mean():
    assert dispersion(np.array([1.0, 3.0])) == pytest.approx(0.5)  # (1 + 1) / (2 * 2)
    assert dispersion(np.array([2.0, 2.0, 2.0])) == 0.0
    assert dispersion(np.zeros(3)) == 0.0


def test_negative_threshold_is_rejected():
    with pytest.raises(ValueError, match="threshold"):
        ampa(CostTable.from_arrays([1.0, 1.0], [1.0, 1.0]), 2, threshold=-1)
