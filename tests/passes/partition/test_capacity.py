"""The planners' memory is print(pipe)'s: Capacity equals Partition.evaluate's per-stage memory,
the symbolic walk equals the numeric one, and a memory not monotone in a stage's end still
gets a partition from every planner."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.cost import CostTable, Partition, stage_bytes
from fxpipe.memory import (
    MemoryBudget,
    peak_of,
    stage_actions,
    stage_let_go,
    stage_peak,
    stage_terms,
)
from fxpipe.passes.partition import ampa, balanced, brute_force, csimd, exact, imd
from fxpipe.passes.partition.capped import Capacity, smallest_scale
from fxpipe.passes.partition.least_cap import least_scale

SCHEDULES = ["gpipe", "1f1b", "zb-h1"]


def _table(rng: np.random.Generator, units: int) -> CostTable:
    """Every byte field the memory model reads, drawn independently."""
    cost = CostTable.from_arrays(1 + rng.uniform(0, 10, units), 1 + rng.uniform(0, 10, units),
                                 param_bytes=rng.integers(0, 100, units).astype(float),
                                 activation_bytes=rng.uniform(0, 100, units),
                                 boundary_bytes=rng.uniform(0, 60, units))
    saved = cost.boundary_bytes * rng.uniform(0, 1, units)  # autograd saves part of them
    # values' lifetimes (a recomputing stage's segments) measured or not, and a checkpoint's
    lifetimes = np.triu(rng.uniform(0, 60, (1, units, units)), 1) if rng.random() < 0.5 else None
    return dataclasses.replace(cost, boundary_grad_bytes=rng.uniform(0, 60, (1, units)),
                               boundary_saved_bytes=saved, output_bytes=rng.uniform(0, 30, 1),
                               weight_cast_bytes=rng.uniform(0, 50, units),
                               inner_grad_bytes=rng.uniform(0, 60, (1, units)),
                               lifetime_bytes=lifetimes, checkpoint_bytes=rng.uniform(0, 20))


@st.composite
def instances(draw):
    units = draw(st.integers(1, 8))
    stages = draw(st.integers(1, min(units, 4)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    cuts = sorted(draw(st.sets(st.integers(1, units - 1), min_size=stages - 1,
                               max_size=stages - 1))) if stages > 1 else []
    recompute = tuple(draw(st.lists(st.booleans(), min_size=stages, max_size=stages)))
    return (_table(rng, units), (*cuts, units), draw(st.integers(1, 5)),
            draw(st.sampled_from(SCHEDULES)), recompute, draw(st.sampled_from([0.0, 1.0, 2.0])))


@settings(max_examples=150, deadline=None)
@given(instances(), st.sampled_from(["none", "stash", "2bw", "predict"]), st.booleans())
def test_capacity_is_exactly_evaluates_stage_memory(instance, consistency, streamed):
    cost, bounds, p, schedule, recompute, slots = instance
    schedule = "async-1f1b" if streamed else schedule  # where the policies' copies differ
    budget = MemoryBudget(1.0, schedule, slots, "auto", consistency=consistency)
    cap = Capacity.of(cost, len(bounds), p, budget)
    part = Partition.evaluate(cost, bounds, p, recompute=recompute, memory=budget)
    planned = [cap.memory(s, a, e, r) for s, (a, e, r) in
               enumerate(zip((0, *bounds[:-1]), bounds, recompute))]
    assert planned == pytest.approx([s.memory for s in part.stages], rel=1e-12, abs=1e-9)
    # and evaluate without a budget counts the same for the same schedule and optimizer
    again = Partition.evaluate(cost, bounds, p, schedule=schedule, optimizer_slots=slots,
                               recompute=recompute, consistency=consistency)
    assert [s.memory for s in again.stages] == [s.memory for s in part.stages]


@settings(max_examples=60, deadline=None)
@given(instances())
def test_the_symbolic_walk_is_stage_peaks_walk(instance):
    """Without recomputation, one stage per device: stage_terms gives stage_peak's Peak, with
    the gradients sent back let go where the planners count them so."""
    cost, bounds, p, schedule, _, _ = instance
    let_go = stage_let_go(schedule, len(bounds), p)
    for s, actions in enumerate(stage_actions(schedule, len(bounds), p)):
        q = stage_bytes(cost, p, bounds, s)
        walked, symbolic = stage_peak(actions, {s: q}, let_go), peak_of(
            stage_terms(actions, let_go=let_go.get(s)), q)
        assert symbolic.total == pytest.approx(walked.total, rel=1e-12, abs=1e-9)


@settings(max_examples=40, deadline=None)
@given(instances(), st.floats(0.3, 1.5))
def test_exact_is_the_brute_force_over_evaluates_memory(instance, share):
    cost, bounds, p, schedule, _, slots = instance
    if cost.units > 7:
        return
    stages = len(bounds)
    unit = MemoryBudget(1.0, schedule, slots, "auto", consistency="stash")  # a copy per stage
    least = smallest_scale(Capacity.of(cost, stages, p, unit))[0]
    assert least_scale(cost, stages, p, unit)[0] == pytest.approx(least, rel=1e-12)
    budget = dataclasses.replace(unit, limit=least * (1 + share))
    truth = brute_force(cost, stages, p, memory=budget)
    found = exact(cost, stages, p, memory=budget)
    assert found.predicted_time == pytest.approx(truth.predicted_time, rel=1e-9)
    limits = budget.limits(stages)
    for planner in (balanced, imd, ampa, exact):
        part = planner(cost, stages, p, memory=budget)
        assert all(s.memory <= cap * (1 + 1e-9) for s, cap in zip(part.stages, limits))
    # the smallest cap (a scale of 1 byte) that fits: the least over every partition and
    # recompute setting of its largest stage memory
    every = [max(s.memory for s in Partition.evaluate(
        cost, (*c, cost.units), p, recompute=r, memory=unit).stages)
        for c in itertools.combinations(range(1, cost.units), stages - 1)
        for r in itertools.product((False, True), repeat=stages)]
    assert least == pytest.approx(min(every), rel=1e-12)


def test_a_stage_that_fits_only_past_a_cut_that_does_not_still_gets_planned():
    """A huge message over the cut after unit 0: stage 0 fits over units 0-1 but not over unit
    0 alone, so a greedy stage that stops at the first end that does not fit finds nothing."""
    cost = CostTable.from_arrays([1.0, 1.0, 1.0], [1.0, 1.0, 1.0],
                                 activation_bytes=[1.0, 1.0, 1.0],
                                 boundary_bytes=[1000.0, 1.0, 0.0])
    budget = MemoryBudget(500.0, "1f1b")
    cap = Capacity.of(cost, 2, 2, budget)
    assert cap.memory(0, 0, 1, False) > 500 >= cap.memory(0, 0, 2, False)
    assert cap.far(0, False)[0] == 0  # no end before the bad one
    for planner in (balanced, imd, ampa, exact):
        assert planner(cost, 2, 2, memory=budget).bounds == (2, 3)
    timed = dataclasses.replace(cost, f=np.ones((2, 3)), b=np.ones((2, 3)), cf=np.zeros((2, 3)),
                                cb=np.zeros((2, 3)), sizes=np.array([1.0, 2.0]), batch=4,
                                activation_bytes=np.ones((2, 3)),
                                boundary_bytes=np.array([[1000.0, 1.0, 0.0]] * 2),
                                boundary_grad_bytes=np.zeros((2, 3)),
                                boundary_saved_bytes=np.zeros((2, 3)), output_bytes=np.zeros(2))
    assert csimd(timed, 2, 4, memory=budget).bounds == (2, 3)
