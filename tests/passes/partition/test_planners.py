"""Every planner: a valid partition for any table, and the same clear errors for bad arguments."""

from __future__ import annotations

import pytest
from hypothesis import given
from partition_tables import assert_valid, instances

from fxpipe.cost import CostTable
from fxpipe.passes.partition import ampa, balanced, csimd, even, exact, imd, params

# name -> (planner(cost, stages, p), may it use fewer than N stages?)
PLANNERS = {
    "even": (even, False),
    "params": (params, False),
    "balanced": (balanced, False),
    "ampa": (ampa, False),
    "ampa-normalized": (lambda c, n, p: ampa(c, n, p, normalize=True), False),
    "imd": (imd, True),
    "imd-eta10": (lambda c, n, p: imd(c, n, p, eta=10), True),
    "csimd": (lambda c, n, p: csimd(c, n, batch=12, p0=p), True),
    "exact": (exact, False),
    "exact-at-most": (lambda c, n, p: exact(c, n, p, at_most=True), True),
    "exact-rho": (lambda c, n, p: exact(c, n, p, objective="rho"), False),
}


@pytest.mark.parametrize("name", PLANNERS)
@given(instance=instances())
def test_every_planner_returns_a_valid_partition(name, instance):
    cost, stages, p = instance
    planner, at_most = PLANNERS[name]
    part = planner(cost, stages, p)
    assert_valid(part, cost.units, stages, at_most)
    if name != "csimd":  # csimd reports the p it chose
        assert part.micro_batches == p


# even.py predates these checks (its errors come from check_bounds / divmod); not covered here.
@pytest.mark.parametrize("name", [name for name in PLANNERS if name != "even"])
def test_bad_stage_counts_and_empty_tables_say_what_to_do(name):
    planner, _ = PLANNERS[name]
    cost = CostTable.from_arrays([1.0, 2.0, 3.0], [1.0, 1.0, 1.0], params=[1, 1, 1])
    with pytest.raises(ValueError, match=r"only 3 units.*use stages <= 3"):
        planner(cost, 4, 1)
    with pytest.raises(ValueError, match="positive integer"):
        planner(cost, 0, 1)
    with pytest.raises(ValueError, match="no units"):
        planner(CostTable.from_arrays([], []), 1, 1)
