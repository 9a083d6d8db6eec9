"""Every planner under a memory cap: its predicted step relative to the capped optimum.

    OMP_NUM_THREADS=1 python benchmarks/capped_planners.py  # 100 instances per part (~5 min CPU)
    python benchmarks/capped_planners.py --quick    # 15 instances per part

(a) Fixed p: EX1-style costs (f, b, cf, cb ~ U[50, 100]), K = 8..40 units, N = 4 stages, p = 4,
    per-unit weights and saved-activation bytes ~ U[1, 100] and U[1, 50] (bytes, any scale),
    GPipe's memory (p micro-batches in flight), Adam's two slots. The cap lies between the
    smallest cap any partition fits and the memory the uncapped optimum needs, so it binds.
    The capped optimum is `exact` under the same cap (verified against brute force in the
    tests); the ratio is each planner's predicted T over it (1.0: optimal).
(b) p chosen: the same with costs and activation bytes that change with the micro-batch size;
    csimd against the least capped optimum over every micro-batch count.
(c) As (a) with recompute="auto" under 1F1B (stage s holds N − s micro-batches): the planners
    choose which stages recompute; the optimum is `exact`, which chooses too. The cap lies
    between the smallest cap with recomputation allowed and the uncapped optimum's memory.
(d) The time to fail when no partition fits (a cap of one byte, K = 2000, N = 16).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

from fxpipe.cost import CostTable
from fxpipe.errors import PlanError
from fxpipe.memory import MemoryBudget
from fxpipe.passes.partition import ampa, balanced, csimd, divisors, exact, imd
from fxpipe.passes.partition.capped import Capacity, smallest_scale

STAGES, P, BATCH = 4, 4, 16
PLAIN = MemoryBudget()  # GPipe's memory, Adam, no recomputation (its limit set per instance)


def table(rng: np.random.Generator, units: int, sizes: np.ndarray | None = None) -> CostTable:
    weights = rng.uniform(1, 100, units)
    if sizes is None:
        f, b, cf, cb = (rng.uniform(50, 100, units) for _ in range(4))
        return CostTable.from_arrays(f, b, cf, cb, param_bytes=weights,
                                     activation_bytes=rng.uniform(1, 50, units),
                                     boundary_bytes=rng.uniform(1, 10, units))
    share = sizes[:, None] / BATCH
    rows = [rng.uniform(50, 100, units) * (floor + (1 - floor) * share ** rng.uniform(0.7, 1.3))
            for floor in (0.2, 0.2, 0.1, 0.1)]
    saved = rng.uniform(1, 50, units) * share * 4  # bytes grow with the micro-batch's samples
    return CostTable.from_arrays(*rows, sizes=sizes, batch=BATCH, param_bytes=weights,
                                 activation_bytes=saved)


def binding_cap(rng: np.random.Generator, cost: CostTable, p: int,
                like: MemoryBudget = PLAIN) -> float | None:
    """A cap between the smallest that fits and what the uncapped optimum needs; None when the
    uncapped optimum already needs the least (no cap can bind)."""
    unit = dataclasses.replace(like, limit=1.0)
    least = smallest_scale(Capacity.of(cost, STAGES, p, unit))[0]
    free = max(s.memory for s in exact(cost, STAGES, p, memory=dataclasses.replace(
        like, recompute=False)).stages)
    if free <= least * (1 + 1e-9):
        return None
    return least + rng.uniform(0.0, 0.9) * (free - least)


def fixed_p(rng: np.random.Generator, count: int, like: MemoryBudget = PLAIN
            ) -> dict[str, list[float]]:
    ratios: dict[str, list[float]] = {name: [] for name in ("balanced", "imd", "ampa", "exact")}
    while len(ratios["exact"]) < count:
        cost = table(rng, int(rng.integers(8, 41)))
        limit = binding_cap(rng, cost, P, like)
        if limit is None:
            continue
        budget = dataclasses.replace(like, limit=limit)
        best = exact(cost, STAGES, P, memory=budget).predicted_time
        for name, planner in (("balanced", balanced), ("imd", imd), ("ampa", ampa),
                              ("exact", exact)):
            part = planner(cost, STAGES, P, memory=budget)
            assert max(s.memory for s in part.stages) <= limit * (1 + 1e-9)
            ratios[name].append(part.predicted_time / best)
    return ratios


def chosen_p(rng: np.random.Generator, count: int) -> dict[str, list[float]]:
    ratios: dict[str, list[float]] = {"csimd": []}
    sizes = 2.0 ** np.arange(int(np.log2(BATCH)) + 1)
    while len(ratios["csimd"]) < count:
        cost = table(rng, int(rng.integers(8, 41)), sizes)
        limit = binding_cap(rng, cost, P)
        if limit is None:
            continue
        budget = MemoryBudget(limit)
        best = []
        for q in divisors(BATCH):
            try:
                best.append(exact(cost, STAGES, q, memory=budget).predicted_time)
            except PlanError:
                continue  # nothing fits at this count
        part = csimd(cost, STAGES, memory=budget)
        assert max(s.memory for s in part.stages) <= limit * (1 + 1e-9)
        ratios["csimd"].append(part.predicted_time / min(best))
    return ratios


def failing(repeats: int) -> list[float]:
    rng = np.random.default_rng(1)
    cost = table(rng, 2000)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            balanced(cost, 16, P, memory=MemoryBudget(1.0))
        except PlanError:
            seconds.append(time.perf_counter() - start)
    return seconds


def report(title: str, ratios: dict[str, list[float]]) -> None:
    print(title)
    print(f"  {'planner':10} {'n':>4} {'median':>8} {'p90':>8} {'max':>8} {'within 5%':>10}")
    for name, values in ratios.items():
        v = np.asarray(values)
        print(f"  {name:10} {len(v):4d} {np.median(v):8.4f} {np.quantile(v, 0.9):8.4f} "
              f"{v.max():8.4f} {np.mean(v <= 1.05):10.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    count = 15 if args.quick else 100
    rng = np.random.default_rng(args.seed)
    report(f"(a) predicted T / capped optimum, p = {P}, N = {STAGES}, {count} capped instances:",
           fixed_p(rng, count))
    report(f"(b) predicted T / least capped optimum over p | {BATCH}, N = {STAGES}:",
           chosen_p(rng, count))
    report("(c) as (a), recompute='auto' under 1f1b's memory:",
           fixed_p(rng, count, MemoryBudget(schedule="1f1b", recompute="auto")))
    seconds = failing(5)
    print(f"(d) no partition fits (K = 2000, N = 16): PlanError after median "
          f"{statistics.median(seconds) * 1e3:.0f} ms (min {min(seconds) * 1e3:.0f}, max "
          f"{max(seconds) * 1e3:.0f}; 5 runs)")


if __name__ == "__main__":
    main()
