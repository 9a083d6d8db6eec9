"""Benchmark: how far each core's own speed moves, and for how long, alone and with every core busy.

A bench row compares a prediction made from timings with steps measured a second later. Where
the machine itself runs slower in one of the two, the row moves off 1 by that much, and steal
time need not show it. This script times fxpipe's fixed piece of work (fxpipe.core_speed's
reference_work) in a process bound to each core, back to back for `--seconds`: first on every
core at once, then on each core alone in turn. It splits the time into windows of `--window`
seconds and takes each window's median; per core it prints the fastest tenth's and the median
window, the share of windows over 25% slower than the fastest tenth ("slow"), and the longest
stretch of slow windows in a row. With `--after-idle S`, it then asks how a core runs right
after it idled: `--tries` times on each core alone, it sleeps S seconds and times the work for
0.3 s, and prints how long the windows ran slow from the start (against the fastest tenth of
that core's windows with every core busy), and how many of the 0.3 s's windows were slow.

    python benchmarks/core_speeds.py --seconds 30 --after-idle 0.5
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import statistics
import time

from fxpipe.core_speed import reference_work

SLOW = 1.25  # a window this much slower than the core's fastest tenth counts as slow


def windows_on(cpu: int, seconds: float, window: float) -> list[float]:
    """Bound to `cpu`, the median time of reference_work in each window of `seconds` (nan for
    a window it did not run in: the process was not running)."""
    os.sched_setaffinity(0, {cpu})
    windows: list[list[float]] = []
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        index = int((now - start) / window)
        while len(windows) <= index:
            windows.append([])
        began = time.perf_counter()
        reference_work()
        windows[index].append(time.perf_counter() - began)
    return [statistics.median(w) if w else math.nan for w in windows]


def fastest_tenth(medians: list[float]) -> float:
    """The window median a tenth of the way from the fastest (nan windows left out)."""
    ran = sorted(m for m in medians if not math.isnan(m))
    return ran[len(ran) // 10]


def report(label: str, cpu: int, medians: list[float], window: float) -> None:
    """Print a core's windows: the fastest tenth's and the median one, the share of slow
    windows and their median, and the longest stretch of slow windows in a row (a window
    without a run breaks a stretch)."""
    ran = [m for m in medians if not math.isnan(m)]
    fast = fastest_tenth(medians)
    slow = [m > SLOW * fast for m in medians]  # nan compares False
    longest = stretch = 0
    for is_slow in slow:
        stretch = stretch + 1 if is_slow else 0
        longest = max(longest, stretch)
    slow_ones = [m for m, s in zip(medians, slow) if s]
    print(f"{label}, core {cpu}: fastest tenth {fast * 1e6:.1f} us, median "
          f"{statistics.median(ran) * 1e6:.1f} us; {len(slow_ones) / len(ran):.0%} of "
          f"{len(ran)} windows of {window * 1e3:g} ms over {SLOW - 1:.0%} slower than the "
          f"fastest tenth (their median "
          f"{statistics.median(slow_ones) * 1e6 if slow_ones else math.nan:.1f} us), the "
          f"longest stretch of them {longest * window * 1e3:g} ms")


def after_idle(cpu: int, idle: float, fast: float, window: float) -> tuple[float, int, int]:
    """Bound to `cpu`: asleep for `idle` seconds, then the work timed for 0.3 s in windows.
    How long the windows ran slow from the start (seconds), how many were slow, of how many."""
    # bound before the sleep (windows_on binds again): the work then runs on a core that idled
    os.sched_setaffinity(0, {cpu})
    time.sleep(idle)
    medians = windows_on(cpu, 0.3, window)
    slow = [m > SLOW * fast for m in medians]
    first = next((i for i, s in enumerate(slow) if not s), len(slow))
    return first * window, sum(slow), len(slow)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=0.01)
    parser.add_argument("--after-idle", type=float, default=0.0,
                        help="seconds asleep before each try on a core (0: no tries)")
    parser.add_argument("--tries", type=int, default=5)
    args = parser.parse_args()
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("this script binds a process to each core in turn: Linux only")
    cpus = sorted(os.sched_getaffinity(0))
    with multiprocessing.Pool(len(cpus)) as pool:
        together = pool.starmap(windows_on, [(cpu, args.seconds, args.window) for cpu in cpus])
    for cpu, medians in zip(cpus, together):
        report("every core busy", cpu, medians, args.window)
    for cpu in cpus:
        with multiprocessing.Pool(1) as pool:
            report("alone", cpu, pool.apply(windows_on, (cpu, args.seconds, args.window)),
                   args.window)
    if args.after_idle <= 0:
        return
    for cpu, medians in zip(cpus, together):
        fast = fastest_tenth(medians)
        with multiprocessing.Pool(1) as pool:
            tries = [pool.apply(after_idle, (cpu, args.after_idle, fast, args.window))
                     for _ in range(args.tries)]
        print(f"after {args.after_idle:g} s idle, core {cpu}: slow from the start for "
              + ", ".join(f"{first * 1e3:g}" for first, _, _ in tries) + " ms; slow windows "
              + ", ".join(f"{slow} of {count}" for _, slow, count in tries))


if __name__ == "__main__":
    main()
