"""Cross-search (ALGORITHMS §4): terminates improving, never loses to its own IMD steps, and
finds the joint optimum where the theory says it must.

Cross-search alone is a coordinate descent, so on general tables it can stop short of the joint
optimum; csimd completes it with IMD at the p it did not reach. benchmarks/planners.py (c2)
measures both."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from partition_tables import BATCH, assert_valid, close, p_tables

from fxpipe.cost import CostTable, step_times
from fxpipe.passes.partition import brute_force, cross_search, csimd, divisors, imd


@given(p_tables(), st.integers(1, 4), st.sampled_from([*divisors(BATCH), 3]), st.data())
def test_cross_search_only_improves_and_beats_imd_at_every_p_it_settled_on(cost, stages, p0,
                                                                           data):
    stages = min(stages, cost.units)
    eta = data.draw(st.sampled_from([10, 1000]))
    search = cross_search(cost, stages, p0=p0, eta=eta)
    part = search.partition
    assert_valid(part, cost.units, stages, at_most=True)
    assert part.micro_batches in {p0, *divisors(BATCH)}
    accepted = [v for v in search.visits if v.accepted]
    assert accepted[0].micro_batches == p0
    assert all(a.time > b.time for a, b in zip(accepted, accepted[1:]))  # strictly decreasing
    assert part.predicted_time <= accepted[0].time * (1 + 1e-12)  # never worse than the start
    assert close(part.predicted_time, accepted[-1].time)
    for visit in accepted:
        p = visit.micro_batches
        alone = step_times(cost, imd(cost, stages, p, eta).bounds, [p])[0]
        assert part.predicted_time <= alone * (1 + 1e-12)


def _within_imds_bound_of_the_joint_optimum(cost, stages, found, eta):
    """With free links, T(λ, p) = Σ(f+b)(p) + (p-1)·ρ(λ, p), and IMD's ρ is within
    OPT(p)·η/(η-1) + ε(p) of the best; so T <= min_p Σ(f+b)(p) + (p-1)·that bound."""
    bound = []
    for p in divisors(BATCH):
        f, b, _, _ = cost.at(p)
        best = brute_force(cost, stages, p, objective="rho", at_most=True)
        opt = best.rho_f + best.rho_b
        eps = 1e-4 * (f.sum() + b.sum())
        bound.append(f.sum() + b.sum() + (p - 1) * (opt * eta / (eta - 1) + eps))
    assert found.predicted_time <= min(bound) * (1 + 1e-9)


@given(p_tables(max_units=7, uniform=True), st.integers(1, 4))
def test_cross_search_reaches_the_joint_optimum_when_the_best_split_does_not_depend_on_p(
    cost, stages
):
    # costs scale by one common function of the micro-batch size and links are free: one
    # partition is best at every p, so the cross-search alone ends within IMD's bound
    stages = min(stages, cost.units)
    found = cross_search(cost, stages, eta=100).partition
    _within_imds_bound_of_the_joint_optimum(cost, stages, found, 100)


@given(p_tables(max_units=7, comm=False), st.integers(1, 4))
def test_csimd_reaches_the_joint_optimum_when_the_best_split_depends_on_p(cost, stages):
    stages = min(stages, cost.units)
    found = csimd(cost, stages, eta=100)
    _within_imds_bound_of_the_joint_optimum(cost, stages, found, 100)


@given(p_tables(), st.integers(1, 4))
def test_csimd_is_never_worse_than_its_cross_search_or_imd_at_any_candidate(cost, stages):
    stages = min(stages, cost.units)
    found = csimd(cost, stages).predicted_time
    assert found <= cross_search(cost, stages).time * (1 + 1e-12)
    for p in divisors(BATCH):
        alone = step_times(cost, imd(cost, stages, p).bounds, [p])[0]
        assert found <= alone * (1 + 1e-12)


def test_csimd_needs_a_batch_size_or_candidates():
    cost = CostTable.from_arrays([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"batch=.*candidates="):
        csimd(cost, 2)
    assert csimd(cost, 2, candidates=[1, 2]).micro_batches == 1
