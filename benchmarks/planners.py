"""Benchmarks of the partitioners: CSIMD's EX1, IMD's speed, and every planner against the optimum.

    python benchmarks/planners.py            # everything (about 7 minutes on 2 cores)
    python benchmarks/planners.py --quick    # a small run of every part (about 15 seconds)
    python benchmarks/planners.py --part a   # only EX1 (also: b = speed, c = planners)

(a) EX1 of the CSIMD paper: f, b, cf, cb ~ U[50, 100], K = 5..100, N = 4, 5, 100 instances each;
    IMD's ρF + ρB against the exact optimum over <= N stages, for η = 10, 100, 1000: the largest
    ratio and PATO (share of instances at the optimum, within a relative 1e-9).
(b) Speed: IMD (η = 1000) against the classic O(N·K²) min-max DP, K = 100..50,000, N = 50, 1000,
    and IMD's ρF + ρB over a lower bound on the optimum, at the default and at a tight ε.
(c) All planners on EX1-style instances: predicted T relative to the exact optimum, at a fixed
    p and, with costs that change nonlinearly with the micro-batch size, with p chosen too.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from fxpipe.cost import CostTable, Partition, step_times
from fxpipe.passes.partition import (
    ampa,
    balanced,
    cross_search,
    csimd,
    divisors,
    even,
    exact,
    imd,
    params,
)

RELATIVE = 1e-9  # "at the optimum" means within this relative gap


def ex1_table(rng: np.random.Generator, units: int) -> CostTable:
    """CSIMD EX1: every per-unit cost ~ U[50, 100]; parameter counts for `params`."""
    f, b, cf, cb = (rng.uniform(50, 100, units) for _ in range(4))
    return CostTable.from_arrays(f, b, cf, cb, params=rng.integers(10_000, 1_000_000, units))


def ex1_p_table(rng: np.random.Generator, units: int, batch: int) -> CostTable:
    """EX1-style costs that depend on the micro-batch size m nonlinearly: U[50, 100] at the full
    batch, a fixed floor (kernel launch, link latency) plus a power law m**γ below it."""
    sizes = 2.0 ** np.arange(int(np.log2(batch)) + 1)
    rows = []
    for floor in (0.2, 0.2, 0.1, 0.1):  # f, b, cf, cb
        full = rng.uniform(50, 100, units)
        gamma = rng.uniform(0.7, 1.3, units)
        rows.append(full * (floor + (1 - floor) * (sizes[:, None] / batch) ** gamma))
    return CostTable.from_arrays(*rows, sizes=sizes, batch=batch,
                                 params=rng.integers(10_000, 1_000_000, units))


def rho(part: Partition) -> float:
    return part.rho_f + part.rho_b


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


# ---------------------------------------------------------------- (a) EX1


def part_a(units: list[int], instances: int, seed: int) -> None:
    etas = (10, 100, 1000)
    print("\n(a) CSIMD EX1: IMD's ρF+ρB vs the exact optimum over <= N stages "
          f"({instances} instances per (K, N), f, b, cf, cb ~ U[50, 100], ε = 1e-4·D_max)")
    summary = {eta: [] for eta in etas}
    for stages in (4, 5):
        rows = []
        for k in units:
            rng = np.random.default_rng([seed, k, stages])
            ratios = {eta: [] for eta in etas}
            for _ in range(instances):
                cost = ex1_table(rng, k)
                opt = rho(exact(cost, stages, objective="rho", at_most=True))
                for eta in etas:
                    ratios[eta].append(rho(imd(cost, stages, eta=eta)) / opt)
            cells = [k]
            cells += [f"{max(ratios[eta]):.6f}" for eta in etas]
            cells += [f"{np.mean(np.array(ratios[eta]) <= 1 + RELATIVE):.2f}" for eta in etas]
            rows.append(cells)
            for eta in etas:
                summary[eta] += ratios[eta]
        print(f"\nN = {stages}")
        print(table(["K", *(f"max η={e}" for e in etas), *(f"PATO η={e}" for e in etas)], rows))
    print("\nover all (K, N):")
    paper = {10: (1.1, 0.45), 100: (1.01, 0.70), 1000: (1.001, 0.95)}
    rows = []
    for eta in etas:
        ratios = np.array(summary[eta])
        # PATO per (K, N) cell: the paper reports its range, so report the worst cell
        cells = ratios.reshape(-1, instances)
        worst_pato = float((cells <= 1 + RELATIVE).mean(axis=1).min())
        rows.append([eta, f"{ratios.max():.6f}", f"<= {paper[eta][0]}",
                     f"{worst_pato:.2f}", f"> {paper[eta][1]}",
                     f"{(ratios <= 1 + RELATIVE).mean():.3f}", f"{1 + 1 / (eta - 1):.6f}"])
    print(table(["η", "max ratio", "paper", "min PATO", "paper", "overall PATO",
                 "Property 3 (η/(η-1))"], rows))


# ---------------------------------------------------------------- (b) speed


def dp_minmax(t: np.ndarray, stages: int) -> float:
    """The classic O(N·K²) DP for the 1-D min-max partition (PipeDream / torchgpipe style):
    best[s][e] = min over st of max(best[s-1][st], sum(t[st:e])), vectorised over st and e."""
    prefix = np.concatenate([[0.0], np.cumsum(t)])
    units = len(t)
    best = prefix.copy()  # one stage: [0, e)
    best[0] = np.inf
    chunk = max(1, 2_000_000 // (units + 1))
    for _ in range(1, stages):
        new = np.full(units + 1, np.inf)
        for lo in range(1, units + 1, chunk):
            e = np.arange(lo, min(lo + chunk, units + 1))
            st = np.arange(units + 1)
            cost = np.maximum(best[None, :], prefix[e][:, None] - prefix[None, :])
            cost[st[None, :] >= e[:, None]] = np.inf
            new[e] = cost.min(axis=1)
        best = new
    return float(best[-1])


def rho_lower_bound(cost: CostTable, stages: int) -> float:
    """max(max f, Σf/N) + max(max b, Σb/N) <= ρF + ρB of any partition into <= N stages."""
    f, b, _, _ = cost.at(1)
    return max(f.max(), f.sum() / stages) + max(b.max(), b.sum() / stages)


def part_b(sizes: dict[int, list[int]], repeats: int, budget: float, seed: int) -> None:
    print(f"\n(b) speed: IMD (η = 1000) vs the O(N·K²) min-max DP; median of {repeats} "
          f"instances, f, b, cf, cb ~ U[50, 100]; the DP is skipped where it would take "
          f"more than {budget:.0f} s (predicted from its N·K² scaling). IMD ρ/LB: the worst "
          f"IMD ρF+ρB over a lower bound on the optimum, with the default ε = 1e-4·D_max and "
          f"with a tight ε (D_max grows with N·OPT, so the default loosens as N grows)")
    dp_last = None  # (N, K, seconds) of the last DP run: predicts the next as N·K²
    for stages, units_list in sizes.items():
        rows, imd_points, dp_points = [], [], []
        for k in units_list:
            rng = np.random.default_rng([seed, k, stages])
            costs = [ex1_table(rng, k) for _ in range(repeats)]
            imd_times, quality, tight = [], [], []
            for cost in costs:
                start = time.perf_counter()
                found = imd(cost, stages, eta=1000)
                imd_times.append(time.perf_counter() - start)
                low = rho_lower_bound(cost, stages)
                quality.append(rho(found) / low)
                tight.append(rho(imd(cost, stages, eta=1000, eps=1e-6 * low)) / low)
            t_imd = statistics.median(imd_times)
            imd_points.append((k, t_imd))
            predicted = (None if dp_last is None
                         else dp_last[2] * stages / dp_last[0] * (k / dp_last[1]) ** 2)
            if predicted is not None and predicted > budget:
                dp_cell, ratio = f"skipped (~{predicted:.0f} s)", ""
            else:
                dp_times = []
                for cost in costs[: max(1, repeats if k <= 2000 else 1)]:
                    f, b, _, _ = cost.at(1)
                    start = time.perf_counter()
                    dp_minmax(f + b, stages)
                    dp_times.append(time.perf_counter() - start)
                t_dp = statistics.median(dp_times)
                dp_last = (stages, k, t_dp)
                dp_points.append((k, t_dp))
                dp_cell, ratio = f"{t_dp:.4f}", f"{t_dp / t_imd:.1f}"
            rows.append([k, f"{t_imd:.4f}", dp_cell, ratio, f"{max(quality):.4f}",
                         f"{max(tight):.4f}"])
        print(f"\nN = {stages}")
        print(table(["K", "IMD s", "DP s", "DP / IMD", "IMD ρ/LB", "ρ/LB, ε=1e-6·LB"], rows))
        for name, points in (("IMD", imd_points), ("DP", dp_points)):
            if len(points) >= 2:
                ks, ts = np.log([p[0] for p in points]), np.log([p[1] for p in points])
                slope = np.polyfit(ks, ts, 1)[0]
                print(f"{name}: fitted log-log slope of time vs K = {slope:.2f} "
                      f"(K = {points[0][0]}..{points[-1][0]})")


# ---------------------------------------------------------------- (c) planners


def fixed_p_planners() -> dict[str, Callable[[CostTable, int, int], Partition]]:
    return {
        "even": even,
        "params": params,
        "balanced": balanced,
        "ampa": ampa,
        "ampa (normalized)": lambda c, n, p: ampa(c, n, p, normalize=True),
        "imd": imd,
        "exact (N stages)": exact,
        "exact (<= N)": lambda c, n, p: exact(c, n, p, at_most=True),
    }


def part_c(units: list[int], instances: int, p: int, batch: int, seed: int) -> None:
    planners = fixed_p_planners()
    print(f"\n(c1) every planner at p = {p} on EX1 tables (f, b, cf, cb ~ U[50, 100]): "
          f"predicted T / optimal T over <= N stages; {instances} instances per (K, N)")
    ratios = {name: [] for name in planners}
    for stages in (4, 5):
        for k in units:
            rng = np.random.default_rng([seed, k, stages, 1])
            for _ in range(instances):
                cost = ex1_table(rng, k)
                times = {name: plan(cost, stages, p).predicted_time
                         for name, plan in planners.items()}
                for name, t in times.items():
                    ratios[name].append(t / times["exact (<= N)"])
    print(table(["planner", "mean T/OPT", "max T/OPT", "at OPT"],
                [[name, f"{np.mean(r):.4f}", f"{np.max(r):.4f}",
                  f"{np.mean(np.array(r) <= 1 + RELATIVE):.2f}"] for name, r in ratios.items()]))

    candidates = divisors(batch)
    print(f"\n(c2) joint (λ, p): costs nonlinear in the micro-batch size (batch {batch}, p in "
          f"{candidates}); each fixed-p planner is run at every p and its best p kept; "
          f"cross-search starts from p0 = 1, csimd completes it with IMD at the p it did not "
          f"reach; T / the joint optimum (exact over <= N stages at "
          f"every p); {instances} instances per (K, N)")
    ratios = {name: [] for name in [*planners, "cross-search alone", "csimd"]}
    for stages in (4, 5):
        for k in units:
            rng = np.random.default_rng([seed, k, stages, 2])
            for _ in range(instances):
                cost = ex1_p_table(rng, k, batch)
                times = {}
                for name, plan in planners.items():
                    times[name] = min(
                        float(step_times(cost, plan(cost, stages, q).bounds, [q])[0])
                        for q in candidates)
                times["cross-search alone"] = cross_search(cost, stages, batch).time
                times["csimd"] = csimd(cost, stages, batch).predicted_time
                for name, t in times.items():
                    ratios[name].append(t / times["exact (<= N)"])
    print(table(["planner", "mean T/OPT", "max T/OPT", "at OPT"],
                [[name, f"{np.mean(r):.4f}", f"{np.max(r):.4f}",
                  f"{np.mean(np.array(r) <= 1 + RELATIVE):.2f}"] for name, r in ratios.items()]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run of every part")
    parser.add_argument("--part", choices=["a", "b", "c", "all"], default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dp-budget", type=float, default=60.0,
                        help="skip a DP run predicted to take longer (seconds)")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.part in ("a", "all"):
        units = [5, 20, 50, 100] if args.quick else list(range(5, 101, 5))
        part_a(units, 20 if args.quick else 100, args.seed)
    if args.part in ("b", "all"):
        if args.quick:
            sizes = {50: [100, 1000, 10_000], 1000: [2000, 10_000]}
        else:
            sizes = {50: [100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000],
                     1000: [2000, 5000, 10_000, 20_000, 50_000]}
        part_b(sizes, 3, 5.0 if args.quick else args.dp_budget, args.seed)
    if args.part in ("c", "all"):
        units = [10, 50] if args.quick else [10, 20, 50, 100]
        part_c(units, 5 if args.quick else 20, p=8, batch=64, seed=args.seed)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
