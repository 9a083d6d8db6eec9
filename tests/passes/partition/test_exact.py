"""`exact` equals brute force on the full cost model, with exactly N or at most N stages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from partition_tables import assert_valid, close, instances, p_tables

from fxpipe.cost import CostTable
from fxpipe.passes.partition import balanced, brute_force, exact


@given(instances(max_units=8, max_stages=4), st.sampled_from(["time", "rho"]), st.booleans())
def test_exact_equals_brute_force(instance, objective, at_most):
    cost, stages, p = instance
    part = exact(cost, stages, p, objective=objective, at_most=at_most)
    assert_valid(part, cost.units, stages, at_most)
    best = brute_force(cost, stages, p, objective=objective, at_most=at_most)
    score = (lambda x: x.predicted_time) if objective == "time" else (lambda x: x.rho_f + x.rho_b)
    assert close(score(part), score(best))


@given(p_tables(max_units=8), st.integers(1, 4), st.sampled_from([1, 2, 4, 8, 16]))
def test_exact_equals_brute_force_on_tables_that_change_with_p(cost, stages, p):
    stages = min(stages, cost.units)
    assert close(exact(cost, stages, p).predicted_time,
                 brute_force(cost, stages, p).predicted_time)


def test_exact_counts_the_boundary_links():
    # every unit has f + b = 3, so compute alone prefers the middle cut (2, 4): ρF = ρB = 10
    # there because its link costs 10 each way: T = 12 + 20 + (2-1)·20 = 52 at p = 2. The cut
    # (1, 4) is free: ρF = 5, ρB = 4, T = 12 + 0 + 9 = 21.
    cost = CostTable.from_arrays([1.0, 2.0, 2.0, 1.0], [2.0, 1.0, 1.0, 2.0],
                                 [0.0, 10.0, 0.0, 0.0], [0.0, 10.0, 0.0, 0.0])
    assert balanced(cost, 2, p=2).predicted_time == 52.0
    assert exact(cost, 2, p=2).predicted_time == 21.0


def test_exact_at_most_may_use_fewer_stages():
    cost = CostTable.from_arrays([1.0, 1.0], [1.0, 1.0], [50.0, 0.0], [50.0, 0.0])
    assert exact(cost, 2, p=2).bounds == (1, 2)  # exactly 2 stages: the only choice
    assert exact(cost, 2, p=2, at_most=True).bounds == (2,)


def test_exact_rejects_unknown_objectives():
    with pytest.raises(ValueError, match="'time' or 'rho'"):
        exact(CostTable.from_arrays([1.0], [1.0]), 1, objective="latency")
