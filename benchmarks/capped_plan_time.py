"""Planning time under a memory cap that lets stages recompute, K = 200 units, N = 4 stages.

    OMP_NUM_THREADS=1 python benchmarks/capped_plan_time.py [--units 200]

The table is measured at five micro-batch sizes (so csimd searches five counts), with values'
lifetimes and a checkpoint's bytes, as a compiled model's is; the cap is 1.3 x the least that
fits under 1F1B with recompute="auto", found first. Each planner then runs in a process of
its own (`--planner`), so none finds the segments' tables another left in their cache; the
segments' table at p = 4 is timed alone first. `exact` is left out: its pair search under a
cap takes minutes at this size.

Result (2026-12-08, 2 shared cores, load about 2; two runs each, seconds): the table 0.60-0.65
(0.74-0.83 before the solver ran a range's bounds at once and skipped starts a bound cannot
improve); csimd 3.95-4.06 (31.9-36.6 before the segments were cached: it made the table six
times per count), balanced 0.60-0.62 (1.98-2.18), imd 0.74-0.80 (2.32-2.33), ampa 0.71-0.89
(4.01-4.09). Every planner's partition is the same as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time

import numpy as np

from fxpipe.cost import CostTable
from fxpipe.memory import MemoryBudget
from fxpipe.passes.partition import ampa, balanced, csimd, imd
from fxpipe.passes.partition.capped import Capacity, smallest_scale
from fxpipe.segments import recompute_table

STAGES, BATCH, P = 4, 16, 4
PLANNERS = {"csimd": csimd, "balanced": balanced, "imd": imd, "ampa": ampa}


def table(units: int) -> CostTable:
    rng = np.random.default_rng(0)
    sizes = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    share = sizes[:, None] / BATCH
    rows = [rng.uniform(50, 100, units) * (floor + (1 - floor) * share ** rng.uniform(0.7, 1.3))
            for floor in (0.2, 0.2, 0.1, 0.1)]
    saved = rng.uniform(1, 50, units) * share * 4
    lifetimes = np.zeros((len(sizes), units, units))
    for m in range(units - 1):  # each unit's values read by one of the next four
        lifetimes[:, m, min(units - 1, m + 1 + int(rng.integers(0, 4)))] = saved[:, m] * 0.3
    cost = CostTable.from_arrays(*rows, sizes=sizes, batch=BATCH,
                                 param_bytes=rng.uniform(1, 100, units), activation_bytes=saved)
    return dataclasses.replace(cost, lifetime_bytes=lifetimes, checkpoint_bytes=3.0)


UNIT = MemoryBudget(1.0, "1f1b", 2.0, "auto")


def run(units: int, name: str, limit: float) -> None:
    cost = table(units)
    if name == "table":
        start = time.perf_counter()
        recompute_table(cost, P)
        print(f"recompute_table at p={P}: {time.perf_counter() - start:.2f} s")
        return
    budget = dataclasses.replace(UNIT, limit=limit)
    start = time.perf_counter()
    part = (csimd(cost, STAGES, memory=budget, schedule="1f1b") if name == "csimd"
            else PLANNERS[name](cost, STAGES, P, memory=budget))
    print(f"{name:9s} {time.perf_counter() - start:7.2f} s  bounds {part.bounds} "
          f"p={part.micro_batches} recompute={part.recompute}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=200)
    parser.add_argument("--planner", choices=["table", *PLANNERS])
    parser.add_argument("--limit", type=float, default=0.0)
    args = parser.parse_args()
    if args.planner:
        run(args.units, args.planner, args.limit)
        return
    limit = smallest_scale(Capacity.of(table(args.units), STAGES, P, UNIT))[0] * 1.3
    for name in ("table", *PLANNERS):
        subprocess.run([sys.executable, __file__, "--units", str(args.units), "--planner", name,
                        "--limit", repr(limit)], check=True)


if __name__ == "__main__":
    main()
