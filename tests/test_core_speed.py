"""The cores' own speed: a fixed piece of work timed on each core, and the bench's line for it."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxpipe.bench import BenchRow, core_speed_line
from fxpipe.core_speed import ALL_CORES_SECONDS, core_times

bindable = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                              reason="binds a thread to a core (Linux)")


@bindable
@given(data=st.data())
def test_every_core_of_the_thread_is_timed_and_the_threads_cores_stay(data):
    allowed = sorted(os.sched_getaffinity(0))
    mine = data.draw(st.sets(st.sampled_from(allowed), min_size=1))
    os.sched_setaffinity(0, mine)
    try:
        times = core_times(seconds=0.002)
        assert set(times) == mine
        assert all(t > 0 for t in times.values())
        assert os.sched_getaffinity(0) == mine
    finally:
        os.sched_setaffinity(0, allowed)


@bindable
def test_each_cores_time_is_of_the_work_run_on_that_core():
    allowed = sorted(os.sched_getaffinity(0))
    for slow in allowed:  # the work takes 3 ms on this core, 0.1 ms on the others

        def work(slow=slow):
            time.sleep(3e-3 if os.sched_getaffinity(0) == {slow} else 1e-4)

        times = core_times(seconds=0.01, work=work)
        assert times[slow] >= 3e-3
        assert all(t < 2e-3 for cpu, t in times.items() if cpu != slow)


@bindable
def test_the_threads_cores_come_back_when_the_work_fails():
    allowed = os.sched_getaffinity(0)
    calls = []

    def work():
        calls.append(os.sched_getaffinity(0))
        if len(calls) > 1:  # past the first, untimed run on the first core
            raise RuntimeError("the work failed")

    with pytest.raises(RuntimeError, match="the work failed"):
        core_times(seconds=0.002, work=work)
    assert calls[0] == {min(allowed)}  # it ran bound
    assert os.sched_getaffinity(0) == allowed


@bindable
def test_a_core_the_thread_cannot_be_bound_to_is_left_out(monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    refused, bind = allowed[-1], os.sched_setaffinity

    def setaffinity(pid, cpus):
        if set(cpus) == {refused} and len(allowed) > 1:
            raise OSError(22, "Invalid argument")
        bind(pid, cpus)

    monkeypatch.setattr(os, "sched_setaffinity", setaffinity)
    times = core_times(seconds=0.002)
    assert set(times) == (set(allowed) - {refused} if len(allowed) > 1 else set(allowed))
    assert os.sched_getaffinity(0) == set(allowed)


@bindable
def test_the_cores_are_timed_for_a_bounded_time_in_all():
    start = time.perf_counter()
    core_times(seconds=1.0)  # more than the cap allows over all of them
    assert time.perf_counter() - start < ALL_CORES_SECONDS + 0.1


def _row(core) -> BenchRow:
    return BenchRow("even", "gpipe", (2, 2), 2, 2.0, 2.0, 0.0, 0.0, (0.0, 0.0),
                    round_core_ms=core)


def test_the_bench_says_how_far_the_cores_speed_moved_over_all_rows():
    line = core_speed_line([_row((0.08, 0.09)), _row(()), _row((0.1,))])
    assert line is not None
    assert line.startswith("core speed during the run: a fixed piece of work took 0.080 to "
                           "0.100 ms on the slowest core after each round's steps, 25% apart, "
                           "over every row")
    assert core_speed_line([_row((0.08,)), _row(())]) is None  # nothing to compare
