"""`params`: the optimum of the largest per-stage parameter count, by brute force."""

from __future__ import annotations

import pytest
from hypothesis import given
from partition_tables import instances

from fxpipe.cost import CostTable
from fxpipe.passes.partition import brute_force, params


@given(instances())
def test_params_minimises_the_largest_stage_parameter_count(instance):
    cost, stages, p = instance
    part = params(cost, stages, p)
    best = brute_force(cost, stages, p, objective="params")
    # integer parameter counts: the optimum is exact
    assert max(s.params for s in part.stages) == max(s.params for s in best.stages)
    assert len(part.bounds) == stages


def test_params_ignores_times():
    cost = CostTable.from_arrays([100.0, 1.0, 1.0, 1.0], [1.0] * 4, params=[1, 1, 1, 3])
    assert params(cost, 2).bounds == (3, 4)


def test_params_without_parameter_counts_says_what_to_do():
    cost = CostTable.from_arrays([1.0, 2.0], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"no parameter counts.*params=.*'even'"):
        params(cost, 2)
