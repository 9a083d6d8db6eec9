"""recompute="auto" under a memory cap: which stages recompute, balanced's step objective, and
an error that suggests recomputation only where it can help."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from partition_tables import capped, close, fits

from fxpipe import Plan
from fxpipe.compiler.partitioning import memory_budget
from fxpipe.cost import CostTable
from fxpipe.errors import PlanError
from fxpipe.memory import MemoryBudget
from fxpipe.passes.partition import ampa, balanced, exact, imd
from fxpipe.passes.partition.balanced import OBJECTIVES
from fxpipe.passes.partition.capped import Capacity


@settings(max_examples=30, deadline=None)
@given(capped(), st.data())
def test_given_bounds_the_settings_chosen_are_the_fastest_that_fit(instance, data):
    cost, stages, p, budget = instance
    cuts = data.draw(st.lists(st.integers(1, cost.units - 1), min_size=stages - 1,
                              max_size=stages - 1, unique=True).map(sorted))
    bounds = (*cuts, cost.units)
    cap = Capacity.of(cost, stages, p, budget)
    spans = list(zip((0, *cuts), bounds))
    every = [cap.evaluate(cost, bounds, "given", again) for again in itertools.product(*cap.modes)
             if all(cap.memory(s, a, e, r) <= cap.limits[s] * (1 + 1e-9)
                    for s, ((a, e), r) in enumerate(zip(spans, again)))]
    chosen = cap.evaluate(cost, bounds, "given")
    if not every:
        assert chosen is None
        return
    assert fits(chosen, budget)
    assert close(chosen.predicted_time, min(part.predicted_time for part in every))


@settings(max_examples=30, deadline=None)
@given(capped(), st.sampled_from([balanced, imd, ampa, exact]))
def test_a_stage_recomputes_only_where_it_does_not_fit_without(instance, planner):
    cost, stages, p, budget = instance
    try:
        part = planner(cost, stages, p, memory=budget)
    except PlanError:
        return  # nothing fits (test_capped checks when)
    cap = Capacity.of(cost, stages, p, budget)
    for s, ((a, e), again) in enumerate(zip((x.units for x in part.stages),
                                            part.recompute or (False,) * stages)):
        if again and False in cap.modes[s]:
            assert cap.memory(s, a, e, False) > cap.limits[s] * (1 + 1e-9)


def test_balanced_takes_a_larger_stage_that_spares_a_recomputation():
    # f + b = 5, 4, 3, 8; under 1f1b stage 0 holds two micro-batches, stage 1 one. The least
    # largest stage time is (2, 4): units 0-1 hold 2 × 50 bytes > 80, so stage 0 recomputes
    # (2·5 + 4 = 14), stage 1 takes 11: a step of 25 + 2 × 14 = 53. (1, 4) recomputes
    # nothing (60 and 50 bytes fit): 20 + 2 × 15 = 50, the faster step and balanced's.
    cost = CostTable.from_arrays([2.0, 3.0, 1.0, 4.0], [3.0, 1.0, 2.0, 4.0],
                                 activation_bytes=[30.0, 20.0, 20.0, 10.0],
                                 boundary_bytes=[0.0] * 4)
    budget = MemoryBudget(80.0, "1f1b", 0.0, "auto")
    assert Capacity.of(cost, 2, 3, budget).settings((2, 4)) == (True, False)
    part = balanced(cost, 2, 3, memory=budget)
    assert part.bounds == (1, 4) and part.recompute == ()
    assert OBJECTIVES["compute_step"](part) == 50.0 == part.predicted_time
    assert max(s.f + s.b for s in part.stages) == 15.0
    # at p = 1 stage 0 holds one micro-batch: nothing recomputes, so the min-max split
    alone = balanced(cost, 2, 1, memory=budget)
    assert alone.bounds == (2, 4) and alone.recompute == ()


def _no_fit(budget: MemoryBudget) -> str:
    rng = np.random.default_rng(0)
    cost = CostTable.from_arrays(rng.uniform(1, 2, 6), rng.uniform(1, 2, 6),
                                 params=rng.integers(10, 20, 6),
                                 activation_bytes=rng.uniform(100, 200, 6))
    with pytest.raises(PlanError, match="no partition into 2 stages fits") as error:
        balanced(cost, 2, 4, memory=budget)
    return str(error.value)


def test_the_error_suggests_recompute_auto_only_where_it_can_help():
    hint = "recompute='auto'"
    assert hint in _no_fit(MemoryBudget(100.0, "1f1b"))
    assert hint in _no_fit(MemoryBudget(100.0, "1f1b", recompute=(False, False)))
    assert hint not in _no_fit(MemoryBudget(100.0, "1f1b", recompute="auto"))  # it already does
    reason = "with schedule='async-1f1b' needs consistency='stash' or '2bw'"
    refused = _no_fit(MemoryBudget(100.0, "1f1b", cannot_recompute=reason))
    assert hint not in refused  # and it says why recomputation cannot help
    assert refused.endswith(f"; recomputation {reason}")


@pytest.mark.parametrize("consistency, possible", [("none", False), ("predict", False),
                                                   ("stash", True)])
def test_a_plan_whose_schedule_cannot_recompute_says_so_to_the_planners(consistency, possible):
    for recompute in (False, "auto"):
        plan = Plan(stages=2, micro_batches=2, schedule="async-1f1b", consistency=consistency,
                    memory_limit=1000, recompute=recompute)
        budget = memory_budget(plan, 2)
        assert (budget.cannot_recompute is None) == possible
        assert budget.may_recompute == (possible and recompute == "auto")
        assert ("recompute='auto'" in _no_fit(budget)) == (possible and not recompute)
