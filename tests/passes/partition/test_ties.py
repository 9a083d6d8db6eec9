"""Ties between partitions go towards balance, the same way on every call."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxpipe.cost import CostTable
from fxpipe.passes.partition import ampa, balanced, csimd, exact, imd, params
from fxpipe.passes.partition.even import even_bounds

# name -> planner(cost, stages, p); those that may use fewer stages get tables without links
EXACTLY_N = {
    "balanced": balanced, "params": params, "ampa": ampa, "exact": exact,
    "exact-rho": lambda c, n, p: exact(c, n, p, objective="rho"),
}
AT_MOST_N = {
    "imd": imd, "csimd": lambda c, n, p: csimd(c, n, batch=12, p0=p),
    "exact-at-most": lambda c, n, p: exact(c, n, p, at_most=True),
}


@st.composite
def identical_units(draw, links: bool):
    units = draw(st.integers(1, 12))
    f, b = draw(st.floats(0.1, 10.0)), draw(st.floats(0.1, 10.0))
    link = [draw(st.floats(0.0, 5.0)) if links else 0.0] * units
    cost = CostTable.from_arrays([f] * units, [b] * units, link, link, params=[7] * units)
    return cost, draw(st.integers(1, min(units, 5))), draw(st.integers(1, 4))


@pytest.mark.parametrize("name", [*EXACTLY_N, *AT_MOST_N])
@given(data=st.data())
def test_identical_units_get_the_even_split_from_every_planner(name, data):
    cost, stages, p = data.draw(identical_units(links=name in EXACTLY_N))
    planner = {**EXACTLY_N, **AT_MOST_N}[name]
    assert planner(cost, stages, p).bounds == even_bounds(cost.units, stages)


@pytest.mark.parametrize("name", [*EXACTLY_N, *AT_MOST_N])
@given(units=st.integers(2, 10), stages=st.integers(1, 4), p=st.integers(1, 4),
       seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1e-15, 1e-9, 1e-3, 0.2]))
def test_noisy_costs_give_the_same_partition_on_every_call(name, units, stages, p, seed, scale):
    rng = np.random.default_rng(seed)
    f, b = 1.0 + scale * rng.standard_normal((2, units))
    stages = min(stages, units)
    planner = {**EXACTLY_N, **AT_MOST_N}[name]
    first = planner(CostTable.from_arrays(f, b, params=[7] * units), stages, p)
    again = planner(CostTable.from_arrays(f.copy(), b.copy(), params=[7] * units), stages, p)
    assert first.bounds == again.bounds
    if scale < 1e-12:  # float noise only: still a tie, so still the even split
        assert first.bounds == even_bounds(units, stages)
