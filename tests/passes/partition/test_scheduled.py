"""Planning for a schedule: csimd's (partition, p) scored by the schedule's simulated step.

csimd's search is heuristic: its partitions are IMD's at each candidate p (and the closed
form's choice), not every partition. So the brute force it must equal is over that search
space, every partition it met × every candidate p, simulated here directly; over all
partitions it may be beaten."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from partition_tables import BATCH, p_tables

from fxpipe import Plan
from fxpipe.compiler.partitioning import choose_partition_of, exactly_n_stages
from fxpipe.cost import CostTable, Partition
from fxpipe.passes.partition import csimd, divisors, imd
from fxpipe.passes.partition.scheduled import step_lower_bounds
from fxpipe.schedules import Schedule, build, gpipe
from fxpipe.simulate import simulate

SCHEDULES = ("1f1b", "zb-h1", "async-1f1b")


def simulated_step(cost: CostTable, bounds, p: int, schedule: str) -> float:
    """The step of `schedule` for `bounds` at p, played by the simulator from the table."""
    f, b, cf, cb = cost.at(p)
    starts, ends = (0, *bounds[:-1]), bounds
    stage_f = [f[a:z].sum() for a, z in zip(starts, ends)]
    stage_b = [b[a:z].sum() for a, z in zip(starts, ends)]
    links_f = [cf[z - 1] for z in ends[:-1]] + [0.0]
    links_b = [cb[z - 1] for z in ends[:-1]] + [0.0]
    plan = build(schedule, len(bounds), p)
    return simulate(plan, stage_f, stage_b, links_f, links_b).makespan / plan.minibatches


@st.composite
def partitions(draw, cost: CostTable, max_stages: int = 4) -> tuple[int, ...]:
    cuts = draw(st.sets(st.integers(1, cost.units - 1), max_size=max_stages - 1))
    return (*sorted(cuts), cost.units)


@settings(max_examples=15)
@given(p_tables(max_units=6), st.sampled_from(SCHEDULES), st.data())
def test_lower_bounds_never_exceed_the_simulated_step(cost, schedule, data):
    bounds = data.draw(partitions(cost))
    counts = divisors(BATCH)
    bounds_found = step_lower_bounds(cost, bounds, counts, schedule)
    for p, bound in zip(counts, bounds_found):
        step = simulated_step(cost, bounds, p, schedule)
        assert bound <= step * (1 + 1e-9)
        assert step == pytest.approx(
            Partition.evaluate(cost, bounds, p, schedule=schedule).predicted_time, rel=1e-12)


@given(st.integers(1, 4), st.integers(1, 6), st.floats(0.1, 10), st.floats(0.1, 10))
def test_lower_bounds_are_the_step_of_balanced_stages_without_links(n, p, f, b):
    # 1F1B's for any f and b; ZB-H1's where F, B and W take the same time (b = 2f)
    bounds = tuple(range(1, n + 1))
    for schedule, backward in (("1f1b", b), ("zb-h1", 2 * f)):
        cost = CostTable.from_arrays([f] * n, [backward] * n)
        bound = step_lower_bounds(cost, bounds, [p], schedule)[0]
        assert bound == pytest.approx(simulated_step(cost, bounds, p, schedule))


@settings(max_examples=12)
@given(p_tables(max_units=6), st.integers(1, 4), st.sampled_from(SCHEDULES))
def test_csimd_for_a_schedule_is_the_best_of_its_search_space_and_no_worse_than_gpipes_choice(
    cost, stages, schedule
):
    stages = min(stages, cost.units)
    counts = divisors(BATCH)
    closed = csimd(cost, stages)
    chosen = csimd(cost, stages, schedule=schedule)
    assert chosen.schedule == schedule and chosen.micro_batches in counts
    step = simulated_step(cost, chosen.bounds, chosen.micro_batches, schedule)
    assert chosen.predicted_time == pytest.approx(step, rel=1e-12)
    # knowing the schedule never makes the step longer than the closed form's choice
    assert step <= simulated_step(cost, closed.bounds, closed.micro_batches, schedule) * (
        1 + 1e-12)
    # and it is the best pair of the search space (IMD's partition at every p, the closed
    # form's choice) x the candidate counts, to the planners' tie tolerance
    space = {imd(cost, stages, q).bounds for q in counts} | {closed.bounds}
    best = min(simulated_step(cost, bounds, p, schedule) for bounds in space for p in counts)
    assert best * (1 - 1e-9) <= step <= best * (1 + 1e-9)


@settings(max_examples=10)
@given(p_tables(max_units=6), st.integers(2, 3))
def test_gpipe_keeps_the_closed_form_which_is_its_simulated_step(cost, stages):
    stages = min(stages, cost.units)
    chosen = csimd(cost, stages, schedule="gpipe")
    assert chosen.schedule == "gpipe"
    assert chosen.predicted_time == pytest.approx(
        simulated_step(cost, chosen.bounds, chosen.micro_batches, "gpipe"), rel=1e-9)


def test_the_schedule_changes_csimds_choice_where_it_changes_the_step():
    # unequal stages: GPipe's step (the closed form) and 1F1B's differ, and so do their best
    # micro-batch counts; the planner picks 1F1B's best pair, shorter under 1F1B than GPipe's
    sizes = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    f = np.array([5.0, 0.0, 3.0]) + sizes[:, None]
    cost = CostTable.from_arrays(f, 2 * f, sizes=sizes, batch=16)
    closed, chosen = csimd(cost, 3), csimd(cost, 3, schedule="1f1b")
    pairs = [simulated_step(cost, imd(cost, 3, q).bounds, p, "1f1b")
             for q in divisors(16) for p in divisors(16)]
    assert chosen.predicted_time == pytest.approx(min(pairs))
    assert chosen.micro_batches != closed.micro_batches
    assert chosen.predicted_time < simulated_step(cost, closed.bounds, closed.micro_batches,
                                                  "1f1b")


@settings(max_examples=8)
@given(p_tables(min_units=3, max_units=6), st.sampled_from(["1f1b", "zb-h1"]))
def test_the_plans_schedule_reaches_csimd_and_auto(cost, schedule):
    plan = Plan(stages=3, partitioner="csimd", schedule=schedule)
    part = choose_partition_of("Net", plan, cost)
    found = csimd(cost, 3, cost.batch, schedule=schedule)
    assert part.micro_batches == found.micro_batches and part.schedule == schedule
    assert part.bounds == exactly_n_stages(found.bounds, 3, cost, found.micro_batches)
    assert part.predicted_time == pytest.approx(
        simulated_step(cost, part.bounds, part.micro_batches, schedule), rel=1e-12)
    auto = choose_partition_of("Net", Plan(stages=3, micro_batches="auto", schedule=schedule),
                               cost)
    assert auto.micro_batches == found.micro_batches and auto.partitioner == "balanced"


@pytest.mark.parametrize("schedule, message", [
    (gpipe(2, 2), "csimd chooses the micro-batch count, which a Schedule of your own fixes"),
    ("interleaved-1f1b", "csimd scores the schedules gpipe, 1f1b, async-1f1b, zb-h1, not "
                         "'interleaved-1f1b'"),
])
def test_csimd_says_which_schedules_it_scores(schedule, message):
    cost = CostTable.from_arrays([1.0, 2.0], [2.0, 4.0], batch=4)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        csimd(cost, 2, schedule=schedule)


@settings(max_examples=8)
@given(p_tables(min_units=2, max_units=5), st.sampled_from(["1f1b", "zb-h1"]),
       st.integers(1, 4))
def test_a_users_schedule_is_scored_by_its_simulated_step(cost, name, p):
    mine = Schedule("mine", 2, p, build(name, 2, p).actions)
    part = choose_partition_of("Net", Plan(stages=2, schedule=mine, partitioner="balanced"),
                               cost)
    assert part.schedule == "mine" and part.micro_batches == p
    assert part.predicted_time == pytest.approx(
        simulated_step(cost, part.bounds, p, name), rel=1e-12)
