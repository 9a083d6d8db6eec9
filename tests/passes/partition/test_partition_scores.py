"""How planners score a partition: the closed form of ALGORITHMS §1, by hand and vectorised."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from partition_tables import close, p_tables, tables

from fxpipe.cost import CostTable, Partition, step_times
from fxpipe.passes.partition import even


def test_partition_evaluate_matches_a_hand_worked_example():
    # stage 1 = units 0-1: F = 3, B = 5, link after unit 1: CF = 1, CB = 6
    # stage 2 = unit 2:    F = 3, B = 4, no link
    # ρF = max(3, 1, 3) = 3, ρB = max(5, 6, 4) = 6, one trip = 3 + 1 + 5 + 6 + 3 + 4 = 22
    cost = CostTable.from_arrays([1.0, 2.0, 3.0], [2.0, 3.0, 4.0], [0.5, 1.0, 9.0],
                                 [0.5, 6.0, 9.0])
    part = Partition.evaluate(cost, (2, 3), p=4)
    assert (part.rho_f, part.rho_b) == (3.0, 6.0)
    assert part.predicted_time == 22.0 + 3 * (3.0 + 6.0)  # 49
    assert part.bubble == 1.0 - 4 * 15.0 / (2 * 49.0)  # busy p·Σ(f+b) over N·T


@given(st.one_of(tables(max_units=10), p_tables(max_units=10)), st.data())
def test_partition_evaluate_equals_step_times(cost, data):
    cuts = data.draw(st.sets(st.integers(1, cost.units - 1), max_size=cost.units - 1)) \
        if cost.units > 1 else set()
    bounds = (*sorted(cuts), cost.units)
    counts = data.draw(st.lists(st.integers(1, 16), min_size=1, max_size=6))
    times = step_times(cost, bounds, counts)
    for p, t in zip(counts, times):
        assert close(Partition.evaluate(cost, bounds, p).predicted_time, t)


def test_even_split_of_a_uniform_pipeline_has_the_textbook_bubble():
    # N equal stages, no communication: bubble = (N - 1) / (p + N - 1)
    cost = CostTable.from_arrays([1.0] * 8, [2.0] * 8)
    for stages in (1, 2, 4, 8):
        for p in (1, 3, 8):
            assert close(even(cost, stages, p).bubble, (stages - 1) / (p + stages - 1))
