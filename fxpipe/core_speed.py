"""A fixed piece of work timed on each core: the machine's own speed, which steal does not show."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable

__all__ = ["ALL_CORES_SECONDS", "CORE_SECONDS", "core_times", "reference_work"]

# seconds the work is timed for on each core, and on all of them together about at most: a
# few hundred repetitions on each of a few cores, little beside a bench round's second or so
CORE_SECONDS = 0.02
ALL_CORES_SECONDS = 0.1


def reference_work() -> None:
    """A fixed piece of pure-Python work of about 0.1 ms, on one thread (no library's own
    threads), so that what moves its time is the core's speed."""
    total = 0
    for i in range(2000):
        total += i * i


def core_times(seconds: float = CORE_SECONDS, work: Callable[[], None] = reference_work
               ) -> dict[int, float]:
    """Per CPU this thread may run on, the median seconds of `work` there, timed for `seconds`
    (for about ALL_CORES_SECONDS over all of them at most, and at least once each) with the
    thread bound to each CPU in turn; the thread's own CPUs are restored after, even where
    `work` raises. A virtual machine's core can run its work far slower for a stretch with no
    steal time to show for it (benchmarks/core_speeds.py). CPUs the thread cannot be bound to
    are left out: {} where none can (not Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return {}
    own = os.sched_getaffinity(0)
    per_core = min(seconds, ALL_CORES_SECONDS / len(own))
    times: dict[int, float] = {}
    try:
        for cpu in sorted(own):
            try:
                os.sched_setaffinity(0, {cpu})  # 0: this thread; the kernel moves it there now
            except OSError:  # taken out of the thread's cpuset meanwhile, say
                continue
            work()  # once untimed: the move, and cold caches on the new core
            samples = []
            end = time.perf_counter() + per_core
            while not samples or time.perf_counter() < end:
                start = time.perf_counter()
                work()
                samples.append(time.perf_counter() - start)
            times[cpu] = statistics.median(samples)
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, own)
    return times
