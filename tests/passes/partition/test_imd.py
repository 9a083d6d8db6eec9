"""MASP and IMD (ALGORITHMS §3): MASP's verdict is exact, IMD meets CSIMD's Property 3."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from partition_tables import assert_valid, instances, tables

from fxpipe.cost import CostTable
from fxpipe.passes.partition import balanced, brute_force, exact, imd, masp
from fxpipe.passes.partition.imd import Packing


def _fewest_stages_within(cost: CostTable, v1: float, v2: float) -> int | None:
    """Brute force: the fewest stages of any partition whose sums and links fit the caps
    (with MASP's documented float slack)."""
    f, b, cf, cb = cost.at(1)
    slack = Packing.of(cost).tol
    v1, v2 = v1 + slack, v2 + slack
    units = cost.units
    for count in range(1, units + 1):
        for cuts in itertools.combinations(range(1, units), count - 1):
            edges = (0, *cuts, units)
            if all(f[a:e].sum() <= v1 and b[a:e].sum() <= v2
                   and (e == units or (cf[e - 1] <= v1 and cb[e - 1] <= v2))
                   for a, e in zip(edges, edges[1:])):
                return count
    return None


@st.composite
def caps(draw, cost: CostTable) -> float:
    """A cap that is exactly some stage sum or link cost (the boundary case), or any value."""
    f, b, cf, cb = cost.at(1)
    pick = draw(st.sampled_from(["f", "b", "any"]))
    if pick == "any":
        return draw(st.floats(0.0, float(f.sum() + b.sum() + cf.sum() + cb.sum()) + 1.0))
    values, links = (f, cf) if pick == "f" else (b, cb)
    a = draw(st.integers(0, cost.units - 1))
    e = draw(st.integers(a + 1, cost.units))
    return float(draw(st.sampled_from([values[a:e].sum(), links[a]])))


@given(st.data())
def test_masp_finds_the_fewest_stages_exactly_when_some_partition_fits(data):
    cost = data.draw(tables(max_units=7))
    v1, v2 = data.draw(caps(cost)), data.draw(caps(cost))
    bounds = masp(cost, v1, v2)
    fewest = _fewest_stages_within(cost, v1, v2)
    assert (bounds is None) == (fewest is None)
    if bounds is not None:
        assert len(bounds) == fewest


def test_masp_cuts_when_either_sum_overflows():
    # Σb never overflows, Σf does: the paper's AND would keep both units in one stage of f = 6
    cost = CostTable.from_arrays([3.0, 3.0], [0.0, 0.0])
    assert masp(cost, 4.0, 100.0) == (1, 2)


def test_masp_ends_a_stage_at_the_furthest_unit_whose_link_fits():
    # sums allow [0, 3), but the cut after unit 2 costs 5 > cap: end at 2, then [2, 4)
    cost = CostTable.from_arrays([1.0] * 4, [0.0] * 4, [0.0, 0.0, 5.0, 0.0], [0.0] * 4)
    assert masp(cost, 3.0, 10.0) == (2, 4)
    assert masp(cost, 0.5, 10.0) is None  # no unit fits


@given(instances(max_units=8, max_stages=4), st.sampled_from([2, 3, 10, 100, 1000]))
def test_imd_is_within_property_3_of_the_optimum_over_at_most_n_stages(instance, eta):
    cost, stages, p = instance
    part = imd(cost, stages, p, eta=eta)
    assert_valid(part, cost.units, stages, at_most=True)
    f, b, cf, cb = cost.at(p)
    eps = 1e-4 * (f.sum() + b.sum() + cf[:-1].sum() + cb[:-1].sum())  # the default ε
    best = brute_force(cost, stages, p, objective="rho", at_most=True)
    opt = best.rho_f + best.rho_b
    assert part.rho_f + part.rho_b <= opt * eta / (eta - 1) + eps + 1e-9 * max(1.0, opt)


@given(st.integers(5, 40), st.sampled_from([4, 5]), st.integers(0, 2**32 - 1))
def test_imd_on_ex1_instances_is_within_property_3_of_exact(units, stages, seed):
    # CSIMD's EX1 distribution at sizes brute force cannot reach; `exact` is itself checked
    # against brute force in test_exact.py
    rng = np.random.default_rng(seed)
    cost = CostTable.from_arrays(*(rng.uniform(50, 100, units) for _ in range(4)))
    opt = exact(cost, stages, objective="rho", at_most=True)
    opt = opt.rho_f + opt.rho_b
    f, b, cf, cb = cost.at(1)
    eps = 1e-4 * (f.sum() + b.sum() + cf[:-1].sum() + cb[:-1].sum())
    for eta in (10, 1000):
        part = imd(cost, stages, eta=eta)
        assert opt * (1 - 1e-12) <= part.rho_f + part.rho_b <= opt * eta / (eta - 1) + eps


def test_imd_uses_fewer_stages_when_a_cut_only_adds_communication():
    cost = CostTable.from_arrays([1.0, 1.0], [1.0, 1.0], [1000.0, 0.0], [1000.0, 0.0])
    assert imd(cost, 2).bounds == (2,)


def test_imd_balances_forward_and_backward_separately():
    # every unit has f + b = 10, so `balanced` takes the middle split: ρF = ρB = 20. Splitting
    # after the first unit gives ρF = 10, ρB = 20: IMD must find the 30.
    cost = CostTable.from_arrays([10.0, 10.0, 0.0, 0.0], [0.0, 0.0, 10.0, 10.0])
    assert balanced(cost, 2).rho_f + balanced(cost, 2).rho_b == 40.0
    part = imd(cost, 2)
    assert part.rho_f + part.rho_b == pytest.approx(30.0, rel=1e-3)


def test_imd_rejects_a_too_small_eta_or_eps():
    cost = CostTable.from_arrays(np.ones(4), np.ones(4))
    with pytest.raises(ValueError, match="eta"):
        imd(cost, 2, eta=1)
    with pytest.raises(ValueError, match="eps"):
        imd(cost, 2, eps=0.0)
