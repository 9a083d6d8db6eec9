"""Benchmark: how far each core's own speed moves, and for how long, alone and with every core busy.

A bench row compares a prediction made from timings with steps measured a second later. Where
the machine itself runs slower in one of the two, the row moves off 1 by that much, and steal
time need not show it. This script times fxpipe's fixed piece of work (fxpipe.core_speed's
reference_work) in a process bound to each core, back to back for `--seconds`: first on every
core at once, then on each core alone in turn. It splits the time into windows of `--window`
seconds and takes each window's median; per core it prints the fastest tenth's and the median
window, the share of windows over 25% slower than the fastest tenth ("slow"), and the longest
stretch of slow windows in a row.

    python benchmarks/core_speeds.py --seconds 30
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

from fxpipe.core_speed import reference_work

SLOW = 1.25  # a window this much slower than the core's fastest tenth counts as slow


def windows_on(cpu: int, seconds: float, window: float) -> list[float]:
    """Bound to `cpu`, the median time of reference_work in each window of `seconds`."""
    os.sched_setaffinity(0, {cpu})
    medians: list[list[float]] = []
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        index = int((now - start) / window)
        while len(medians) <= index:
            medians.append([])
        began = time.perf_counter()
        reference_work()
        medians[index].append(time.perf_counter() - began)
    return [statistics.median(m) for m in medians if m]


def report(label: str, cpu: int, medians: list[float], window: float) -> None:
    fast = statistics.quantiles(medians, n=10)[0]
    slow = [m > SLOW * fast for m in medians]
    longest = run = 0
    for is_slow in slow:
        run = run + 1 if is_slow else 0
        longest = max(longest, run)
    print(f"{label}, core {cpu}: fastest tenth {fast * 1e6:.1f} us, median "
          f"{statistics.median(medians) * 1e6:.1f} us; {sum(slow) / len(slow):.0%} of "
          f"{len(slow)} windows of {window * 1e3:g} ms over {SLOW - 1:.0%} slower than the "
          f"fastest tenth (their median {_median_of(medians, slow) * 1e6:.1f} us), the longest "
          f"stretch of them {longest * window * 1e3:g} ms")


def _median_of(medians: list[float], chosen: list[bool]) -> float:
    picked = [m for m, c in zip(medians, chosen) if c]
    return statistics.median(picked) if picked else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=0.01)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    with multiprocessing.Pool(len(cpus)) as pool:
        together = pool.starmap(windows_on, [(cpu, args.seconds, args.window) for cpu in cpus])
    for cpu, medians in zip(cpus, together):
        report("every core busy", cpu, medians, args.window)
    for cpu in cpus:
        with multiprocessing.Pool(1) as pool:
            report("alone", cpu, pool.apply(windows_on, (cpu, args.seconds, args.window)),
                   args.window)


if __name__ == "__main__":
    main()
