"""How long a fixed piece of work takes on each core now: the machine's own drift, which steal
time does not show."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

__all__ = ["CORE_SECONDS", "core_times", "reference_work"]

# seconds the work is timed for on each core, and on all of them together at most: enough
# repetitions for a steady median, little beside a bench round's second or so
CORE_SECONDS = 0.02
ALL_CORES_SECONDS = 0.1


def reference_work() -> None:
    """A fixed piece of pure-Python work of about 0.1 ms: one thread, no allocation to speak
    of, no library's own threads, so that only the core's speed moves its time."""
    total = 0
    for i in range(2000):
        total += i * i


def core_times(seconds: float = CORE_SECONDS, work: Callable[[], None] = reference_work
               ) -> dict[int, float]:
    """Per CPU this thread may run on, the median seconds of `work` there, timed for `seconds`
    (at most ALL_CORES_SECONDS over all of them) with the thread bound to each CPU in turn;
    the thread's own CPUs are restored after. On a virtual machine a core slows by a fifth
    for seconds at a time while its host's other guests use its sibling, with no steal time
    to show for it (benchmarks/core_speeds.py). {} where a thread cannot be bound (not
    Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        return {}
    own = os.sched_getaffinity(0)
    per_core = min(seconds, ALL_CORES_SECONDS / len(own))
    times: dict[int, float] = {}
    try:
        for cpu in sorted(own):
            os.sched_setaffinity(0, {cpu})  # 0: this thread; the kernel moves it there now
            work()  # once untimed: the move, and cold caches on the new core
            samples = []
            end = time.perf_counter() + per_core
            while not samples or time.perf_counter() < end:
                start = time.perf_counter()
                work()
                samples.append(time.perf_counter() - start)
            times[cpu] = statistics.median(samples)
    finally:
        os.sched_setaffinity(0, own)
    return times
