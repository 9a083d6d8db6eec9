"""IMD under a memory cap with recomputation: its step against every partition that fits."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from partition_tables import capped

from fxpipe.cost import Partition
from fxpipe.errors import PlanError
from fxpipe.passes.partition import imd
from fxpipe.passes.partition.capped import Capacity


@settings(max_examples=150, deadline=None)
@given(capped(max_units=10, recompute=True))
def test_capped_imd_steps_within_its_volume_bound_of_every_partition_that_fits(instance):
    # T = Σ(f + b) + links + forwards recomputed + (p − 1)·(ρF + ρB): a partition λ lies in
    # some lane at volume ρ(λ)·η/(η − 1), so IMD's step is at most λ's plus (p − 1) times that
    # volume's excess over ρ(λ) and the bisection's ε
    cost, stages, p, budget = instance
    eta, eps = 20, 1e-3
    try:
        part = imd(cost, stages, p, eta, eps, memory=budget)
    except PlanError:
        return  # nothing fits (test_capped checks when)
    if not part.recompute and part.bounds == imd(cost, stages, p, eta, eps).bounds:
        return  # the cap changes nothing: IMD's own objective, ρF + ρB (test_imd)
    cap = Capacity.of(cost, stages, p, budget)
    for cuts in itertools.combinations(range(1, cost.units), stages - 1):
        bounds = (*cuts, cost.units)
        again = cap.settings(bounds)
        if again is None:
            continue  # it does not fit
        other = Partition.evaluate(cost, bounds, p, recompute=again)  # T without the memory
        rho = other.rho_f + other.rho_b
        slack = (p - 1) * (rho / (eta - 1) + eps) + 1e-9 * other.predicted_time
        assert part.predicted_time <= other.predicted_time + slack, (bounds, again)
