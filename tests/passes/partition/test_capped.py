"""Planning under a memory cap: exact equals the capped brute force, every other planner fits
whenever some partition does, and no fit at all names the smallest cap that would."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from partition_tables import BATCH, capped, close, fits

from fxpipe.cost import CostTable, Partition
from fxpipe.errors import PlanError
from fxpipe.memory import MemoryBudget
from fxpipe.passes.partition import (
    ampa,
    balanced,
    brute_force,
    csimd,
    divisors,
    even,
    exact,
    imd,
    params,
)
from fxpipe.passes.partition.balanced import OBJECTIVES
from fxpipe.passes.partition.capped import Capacity, smallest_scale
from fxpipe.passes.partition.least_cap import least_state_split, state_split


def smallest_cap(error: PlanError) -> float | tuple[float, ...]:
    found = re.search(r"memory_limit=(\d+|\[[\d, ]+\]) bytes", str(error))
    assert found, str(error)
    text = found.group(1)
    return (float(text) if not text.startswith("[") else
            tuple(float(x) for x in text.strip("[]").split(",")))


def scaled(budget: MemoryBudget, limit, less: bool = False) -> MemoryBudget:
    """`budget` with the cap `limit` (whole bytes, rounded up), or a little less: a byte, or a
    millionth where that is more."""
    cut = (lambda x: x - max(1.0, 1e-6 * x)) if less else (lambda x: x)
    limit = tuple(map(cut, limit)) if isinstance(limit, tuple) else cut(limit)
    return MemoryBudget(limit, budget.schedule, budget.optimizer_slots, budget.recompute)


@settings(max_examples=40, deadline=None)
@given(capped(), st.sampled_from(["time", "rho"]))
def test_exact_equals_the_capped_brute_force(instance, objective):
    cost, stages, p, budget = instance
    best = brute_force(cost, stages, p, objective, memory=budget)
    if best is None:
        with pytest.raises(PlanError, match="no partition"):
            exact(cost, stages, p, objective, memory=budget)
        return
    part = exact(cost, stages, p, objective, memory=budget)
    assert len(part.bounds) == stages and fits(part, budget)
    score = (lambda x: x.predicted_time) if objective == "time" else (lambda x: x.rho_f + x.rho_b)
    assert close(score(part), score(best))


PLANNERS = {"balanced": balanced, "imd": imd, "ampa": ampa, "exact": exact}


@settings(max_examples=30, deadline=None)
@given(capped(), st.sampled_from(sorted(PLANNERS)))
def test_every_planner_fits_whenever_a_partition_does(instance, name):
    cost, stages, p, budget = instance
    step = OBJECTIVES["compute_step"]  # balanced's objective under a cap
    best = brute_force(cost, stages, p, step, memory=budget)
    planner = PLANNERS[name]
    if best is not None:
        part = planner(cost, stages, p, memory=budget)
        assert len(part.bounds) == stages and fits(part, budget)
        if name == "balanced":  # balanced's own objective: the capped optimum
            assert close(step(part), step(best))
        return
    with pytest.raises(PlanError, match="no partition") as error:
        planner(cost, stages, p, memory=budget)
    limit = smallest_cap(error.value)  # that cap fits, and one slightly smaller does not
    assert fits(planner(cost, stages, p, memory=scaled(budget, limit)), scaled(budget, limit))
    with pytest.raises(PlanError, match="no partition"):
        planner(cost, stages, p, memory=scaled(budget, limit, less=True))


def test_balanced_recomputes_the_least_forward_time_among_its_optima():
    # two splits share the least largest f + b (17): (2, 5) with stage 0 recomputing (2·6 +
    # 5), and (1, 5) with nothing recomputed (stage 1: 8 + 9); the second adds no forward
    cost = CostTable.from_arrays([3.0, 3.0, 3.0, 1.0, 1.0], [2.0, 3.0, 3.0, 1.0, 2.0],
                                 activation_bytes=[40.0, 20.0, 10.0, 30.0, 40.0],
                                 boundary_bytes=[1.0, 1.0, 1.0, 0.0, 2.0])
    budget = MemoryBudget(115.0, "1f1b", 0.0, "auto")
    assert Capacity.of(cost, 2, 3, budget).settings((2, 5)) == (True, False)  # it fits too
    part = balanced(cost, 2, 3, memory=budget)
    assert part.bounds == (1, 5) and part.recompute == ()
    assert max(s.f + s.b for s in part.stages) == 17.0


def some_partition_fits(cost: CostTable, stages: int, p: int, budget: MemoryBudget) -> bool:
    """Whether `brute_force` under `budget` finds a partition (it scores every one it finds,
    where this only asks whether there is one): some bounds and recompute settings whose
    every stage fits its cap."""
    cap = Capacity.of(cost, stages, p, budget)
    return any(all(cap.memory(s, a, e, r) <= cap.limits[s] * (1 + 1e-9)
                   for s, ((a, e), r) in enumerate(zip(zip((0, *cuts), (*cuts, cost.units)),
                                                       again)))
               for cuts in itertools.combinations(range(1, cost.units), stages - 1)
               for again in itertools.product(*cap.modes))


@settings(max_examples=25, deadline=None)
@given(capped())
def test_some_partition_fits_exactly_where_brute_force_finds_one(instance):
    cost, stages, p, budget = instance
    assert some_partition_fits(cost, stages, p, budget) == (
        brute_force(cost, stages, p, memory=budget) is not None)


@settings(max_examples=25, deadline=None)
@given(capped(sizes=True))
def test_csimd_searches_the_micro_batch_counts_that_fit(instance):
    cost, stages, _, budget = instance
    fitting = [q for q in divisors(BATCH) if some_partition_fits(cost, stages, q, budget)]
    if not fitting:
        with pytest.raises(PlanError, match="no micro-batch count"):
            csimd(cost, stages, memory=budget, schedule=budget.schedule)
        return
    part = csimd(cost, stages, memory=budget, schedule=budget.schedule)
    assert part.schedule == budget.schedule
    assert part.micro_batches in fitting and len(part.bounds) == stages
    assert fits(part, budget)


@settings(max_examples=25, deadline=None)
@given(capped(), st.sampled_from([even, params]))
def test_fixed_rules_fit_or_say_which_stage_does_not(instance, planner):
    cost, stages, p, budget = instance
    if brute_force(cost, stages, p, memory=budget) is None:
        with pytest.raises(PlanError, match="no partition"):
            planner(cost, stages, p, memory=budget)
        return
    plain = planner(cost, stages, p)
    fitting = Capacity.of(cost, stages, p, budget).settings(plain.bounds) is not None
    if not fitting:
        with pytest.raises(PlanError, match=r"fixed rule .* stage \d+ \(units .* honours the cap"):
            planner(cost, stages, p, memory=budget)
        return
    part = planner(cost, stages, p, memory=budget)
    assert part.bounds == plain.bounds and fits(part, budget)


def test_recomputation_adds_the_forward_to_the_backward_and_holds_only_inputs():
    cost = CostTable.from_arrays([1.0, 2.0], [3.0, 4.0], params=[10, 0],
                                 activation_bytes=[100.0, 50.0], boundary_bytes=[8.0, 0.0])
    budget = MemoryBudget(schedule="gpipe", optimizer_slots=2.0)
    plain = Partition.evaluate(cost, (1, 2), 4, memory=budget)
    again = Partition.evaluate(cost, (1, 2), 4, recompute=(False, True), memory=budget)
    assert again.recompute == (False, True) and plain.recompute == ()
    assert [s.b for s in again.stages] == [3.0, 4.0 + 2.0]
    # gpipe posts the four receives at the start, and holds four micro-batches' activations
    assert plain.stages[1].memory == 4 * 8.0 + 4 * 50.0
    assert again.stages[1].memory == 4 * 8.0 + 50.0  # their inputs, and one recompute's
    # stage 0's first backward: four micro-batches' activations, three sends (its own
    # micro-batch's came back as a gradient, so was received), and a new weight gradient
    # beside .grad (its workspace)
    assert plain.stages[0].memory == again.stages[0].memory == (
        4 * 10 * 4 + 4 * 100.0 + 3 * 8.0 + 10 * 4)


def test_auto_recomputes_only_the_stage_that_needs_it():
    cost = CostTable.from_arrays([1.0] * 4, [1.0] * 4, activation_bytes=[100.0] * 4,
                                 boundary_bytes=[1.0] * 4)
    budget = MemoryBudget(250.0, "1f1b", 2.0, "auto")  # 1f1b: stage 0 holds 2, stage 1 one
    part = balanced(cost, 2, 4, memory=budget)
    assert part.bounds == (2, 4) and part.recompute == (True, False)
    assert fits(part, budget)


def test_no_fit_fails_fast_naming_the_smallest_cap_and_the_stage():
    rng = np.random.default_rng(0)
    units = 300
    cost = CostTable.from_arrays(rng.uniform(1, 2, units), rng.uniform(1, 2, units),
                                 params=rng.integers(1000, 2000, units),
                                 activation_bytes=rng.uniform(1e5, 2e5, units))
    budget = MemoryBudget(1024.0, "1f1b")
    for planner in (balanced, exact, imd, ampa, even, params):
        with pytest.raises(PlanError, match=r"no partition into 8 stages fits the memory cap"
                           r".* on stage \d+ .*give memory_limit=\d+ bytes"):
            planner(cost, 8, 4, memory=budget)


@given(capped())
def test_the_parameters_bound_refuses_only_caps_no_partition_fits(case):
    cost, stages, p, budget = case
    state = (2.0 + budget.optimizer_slots) * cost.param_bytes  # weights, grads, Adam's two
    limits = budget.limits(stages)
    least = smallest_scale(Capacity.of(cost, stages, p, budget))[0]  # every byte counted
    if state_split(state, limits) is None:
        assert least > 1
    bounds = least_state_split(state, limits)  # the parameters' least share of the caps
    held = np.add.reduceat(state, (0, *bounds[:-1]))
    assert len(bounds) == stages and bounds[-1] == cost.units
    assert (held / limits).max() <= least * (1 + 1e-6)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=7), st.data())
def test_the_parameters_least_split_is_the_brute_force_one(state, data):
    import itertools

    stages = data.draw(st.integers(1, len(state)))
    limits = np.asarray(data.draw(st.lists(st.integers(1, 60), min_size=stages,
                                           max_size=stages)), dtype=float)
    state = np.asarray(state, dtype=float)
    splits = [(*cuts, len(state)) for cuts in
              itertools.combinations(range(1, len(state)), stages - 1)]
    ratio = lambda b: (np.add.reduceat(state, (0, *b[:-1])) / limits).max()  # noqa: E731
    assert (state_split(state, limits) is not None) == any(ratio(b) <= 1 for b in splits)
    assert ratio(least_state_split(state, limits)) == pytest.approx(
        min(map(ratio, splits)), rel=1e-6, abs=1e-12)
