"""Hypothesis strategies for the partitioner tests: cost tables small enough to brute-force."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from fxpipe.cost import CostTable, Partition
from fxpipe.memory import MemoryBudget

# Small integers make ties (the hard case for "first optimum" logic); floats make the rest.
costs = st.one_of(st.integers(0, 20).map(float), st.floats(0.0, 100.0, allow_subnormal=False))

SIZES = np.array([1.0, 2.0, 4.0, 8.0, 16.0])  # micro-batch sizes the p-dependent tables measure
BATCH = 16


@st.composite
def tables(draw, min_units: int = 1, max_units: int = 8, comm: bool = True) -> CostTable:
    """A table that is the same at every p, with parameter counts."""
    units = draw(st.integers(min_units, max_units))
    arrays = [draw(st.lists(costs, min_size=units, max_size=units)) for _ in range(2)]
    for _ in range(2):
        links = draw(st.lists(costs, min_size=units, max_size=units)) if comm else [0.0] * units
        arrays.append(links)
    params = draw(st.lists(st.integers(1, 1000), min_size=units, max_size=units))
    return CostTable.from_arrays(*arrays, params=params)


@st.composite
def instances(draw, max_units: int = 8, max_stages: int = 4, max_p: int = 6, comm: bool = True):
    """(table, stages, p) with 1 <= stages <= units."""
    cost = draw(tables(max_units=max_units, comm=comm))
    stages = draw(st.integers(1, min(cost.units, max_stages)))
    return cost, stages, draw(st.integers(1, max_p))


@st.composite
def p_tables(draw, min_units: int = 2, max_units: int = 7, comm: bool = True,
             uniform: bool = False) -> CostTable:
    """A table measured at several micro-batch sizes, nonlinear in the size: a fixed overhead
    per micro-batch plus a per-sample cost with an exponent, as real kernels behave.

    With `uniform`, every unit's time is its own constant times one shared function of the
    size and there is no communication, so the best partition is the same at every p."""
    units = draw(st.integers(min_units, max_units))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if uniform:
        shape = 1.0 + rng.uniform(0.1, 2.0) * SIZES ** rng.uniform(0.7, 1.3)
        f = np.outer(shape, rng.uniform(1, 100, units))
        b = np.outer(shape, rng.uniform(1, 100, units))
        return CostTable.from_arrays(f, b, sizes=SIZES, batch=BATCH)

    def curve() -> np.ndarray:  # (sizes, units)
        overhead, rate = rng.uniform(1, 50, units), rng.uniform(0.1, 10, units)
        return overhead + rate * SIZES[:, None] ** rng.uniform(0.6, 1.4, units)

    links = [curve() * (rng.uniform() < 0.8) if comm else np.zeros((len(SIZES), units))
             for _ in range(2)]
    return CostTable.from_arrays(curve(), curve(), *links, sizes=SIZES, batch=BATCH)


def assert_valid(part: Partition, units: int, stages: int, at_most: bool = False) -> None:
    """Contiguous non-empty stages covering every unit once, with the right stage count."""
    bounds = part.bounds
    assert bounds[-1] == units
    assert all(a < b for a, b in zip((0, *bounds), bounds)), bounds
    if at_most:
        assert 1 <= len(bounds) <= stages
    else:
        assert len(bounds) == stages
    covered = [u for s in part.stages for u in range(*s.units)]
    assert covered == list(range(units))


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


SCHEDULES = ["gpipe", "1f1b", "zb-h1"]


@st.composite
def capped(draw, max_units: int = 7, max_stages: int = 4, sizes: bool = False,
           recompute: bool = True):
    """(table with weights, saved and boundary bytes; stages; p; budget). The cap is a share
    of what one stage holding everything needs, so some draws fit and some do not."""
    units = draw(st.integers(2, max_units))
    stages = draw(st.integers(1, min(units, max_stages)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = SIZES[:, None] if sizes else np.ones((1, 1))
    f, b = (1 + rng.uniform(0, 10, units) * rows for _ in range(2))
    cf, cb = (rng.uniform(0, 5, units) * rows * (rng.uniform() < 0.7) for _ in range(2))
    weights = rng.integers(1, 100, units) * (rng.uniform(size=units) < 0.8)
    weights[0] += 1  # params balances parameter counts: give it some
    saved = rng.uniform(0, 100, units) * rows
    crossing = rng.uniform(0, 60, units) * rows
    cost = CostTable.from_arrays(f, b, cf, cb, sizes=SIZES if sizes else None,
                                 batch=BATCH if sizes else None, params=weights,
                                 activation_bytes=saved, boundary_bytes=crossing)
    p = draw(st.integers(1, 4))
    schedule = draw(st.sampled_from(SCHEDULES))
    whole = 16 * weights.sum() + max(p, 2) * saved.max(0).sum()
    share = draw(st.floats(0.1, 1.0))
    per_stage = draw(st.booleans())
    limit = (tuple(whole * share * rng.uniform(0.5, 1.5, stages)) if per_stage
             else float(whole * share))
    mode = draw(st.sampled_from([False, "auto", True])) if recompute else False
    return cost, stages, p, MemoryBudget(limit, schedule, 2.0, mode)


def fits(part: Partition, budget: MemoryBudget) -> bool:
    limits = budget.limits(len(part.stages))
    return all(s.memory <= limit * (1 + 1e-9) for s, limit in zip(part.stages, limits))
