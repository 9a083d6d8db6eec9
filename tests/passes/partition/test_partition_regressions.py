"""Bugs found while building the partitioners, each pinned by the case that exposed it."""

from __future__ import annotations

from fxpipe.cost import CostTable
from fxpipe.passes.partition import brute_force, exact, imd


def test_exact_rho_does_not_turn_infeasible_pairs_into_nan():
    # the value 0·inf (link weight 0 for "rho", no partition within the caps) was nan, argmin
    # picked it, and the batch's feasible optimum (15) was lost to the upper bound's 16
    cost = CostTable.from_arrays([3.0, 4.0, 2.0, 3.0], [5.0, 1.0, 1.0, 1.0],
                                 [9.0, 8.0, 9.0, 5.0], [7.0, 5.0, 4.0, 3.0])
    part = exact(cost, 3, objective="rho")
    assert part.rho_f + part.rho_b == 15.0
    best = brute_force(cost, 3, objective="rho")
    assert best.rho_f + best.rho_b == 15.0


def test_exact_keeps_its_upper_bound_when_rounding_puts_every_pair_just_above_it():
    # N = K leaves one partition; its pair's DP value summed in another order came out one ulp
    # above the bound computed from the same partition, and exact raised
    cost = CostTable.from_arrays([0.0] * 4, [0.0] * 4, [0.0, 71.19500753, 0.0, 0.0],
                                 [57.19500753, 0.0, 70.83037627, 0.0])
    assert exact(cost, 4, p=2).bounds == (1, 2, 3, 4)


def test_imd_on_a_table_of_zeros():
    # the default ε = 1e-4·D_max is 0 here, which the eps check used to reject
    cost = CostTable.from_arrays([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    assert imd(cost, 2).rho_f == 0.0


def test_exact_gives_a_tie_of_every_partition_to_the_even_split():
    # at one micro-batch without links every partition has the same T, and the traceback's
    # last-start rule returned 38 + 1 + 1 + 1
    cost = CostTable.from_arrays([1.0] * 41, [2.0] * 41)
    assert exact(cost, 4, p=1).sizes == (10, 10, 10, 11)
