"""CPU affinity: the ranks on a host get disjoint, equal shares of its CPUs."""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fxpipe import affinity
from fxpipe.affinity import (
    IO_THREADS,
    choose_share,
    core_share,
    format_cpus,
    pin_process,
    pin_rank,
    ranks_on_host,
    release_io_threads,
    stage_cores,
    usable_cores,
)


@given(cpus=st.sets(st.integers(0, 127), min_size=1, max_size=64),
       world=st.integers(1, 16))
def test_every_rank_gets_an_equal_share_of_its_own(cpus, world):
    shares = [core_share(rank, world, cpus) for rank in range(world)]
    if world > len(cpus):  # fewer CPUs than ranks: nobody is bound
        assert shares == [None] * world
        return
    assert all(len(share) == len(cpus) // world for share in shares)
    taken = [cpu for share in shares for cpu in share]
    assert len(taken) == len(set(taken)) and set(taken) <= cpus  # disjoint, and allowed
    ordered = sorted(cpus)
    for share in shares:  # consecutive in the allowed set, not scattered
        first = ordered.index(share[0])
        assert list(share) == ordered[first:first + len(share)]


@given(st.lists(st.tuples(st.sampled_from("ab"), st.booleans(),
                          st.sets(st.integers(0, 7), min_size=1)), min_size=1, max_size=8),
       st.data())
def test_a_rank_counts_the_cpu_ranks_of_its_host_and_the_cpus_they_may_use(everyone, data):
    rank = data.draw(st.integers(0, len(everyone) - 1))
    host = everyone[rank][0]
    ranks, cpus = ranks_on_host(rank, everyone)
    assert ranks == sum(1 for h, on_cpu, _ in everyone if h == host and on_cpu)
    mine = set().union(*(c for h, _, c in everyone if h == host))
    assert cpus == len(mine) >= len(everyone[rank][2])
    assert ranks_on_host(rank, [*everyone, ("c", True, {0})]) == (ranks, cpus)  # other hosts


def test_ranks_on_gpus_do_not_count_but_their_cpus_do():
    everyone = [("a", True, {0, 1}), ("a", False, {2, 3}), ("a", True, {0, 1})]
    assert ranks_on_host(1, everyone) == (2, 4)


def test_a_rank_outside_its_world_gets_nothing():
    assert core_share(2, 2, [0, 1, 2, 3]) is None
    assert core_share(-1, 2, [0, 1]) is None


def test_ranks_share_their_host_in_rank_order_and_leave_a_launchers_placement_alone():
    four = (0, 1, 2, 3)
    everyone = [("a", four), ("b", four), ("a", four), ("b", four)]  # 2 hosts, 2 ranks each
    assert [choose_share(r, everyone) for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    placed = [("a", (0, 1)), ("a", (2, 3))]  # each rank already on CPUs of its own
    assert [choose_share(r, placed) for r in range(2)] == [None, None]
    crowded = [("a", (0,)), ("a", (0,))]
    assert choose_share(0, crowded) is None


def test_cpus_print_as_ranges():
    assert format_cpus([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10,11"
    assert format_cpus([5]) == "5"


def test_nothing_is_bound_with_none_and_no_collective_is_needed():
    assert pin_rank("cpu", "none", []) is None  # returns before comparing with other ranks


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs per-thread affinity and two CPUs")
def test_binding_reaches_threads_already_running_and_the_ones_started_later():
    allowed = os.sched_getaffinity(0)
    one = {min(allowed)}
    running, stop = [], threading.Event()
    before = threading.Thread(target=lambda: (running.append(threading.get_native_id()),
                                              stop.wait()))
    before.start()
    try:
        while not running:
            pass
        assert pin_process(one)
        later = []
        after = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
        after.start()
        after.join()
        assert os.sched_getaffinity(0) == one
        assert os.sched_getaffinity(running[0]) == one
        assert later == [one]
    finally:
        stop.set()
        before.join()
        pin_process(allowed)
    assert os.sched_getaffinity(0) == allowed


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not os.path.isdir("/proc/self/task"),
                    reason="needs per-thread affinity, thread names in /proc and two CPUs")
def test_only_io_threads_are_released_to_the_cpus_the_rank_had(monkeypatch):
    allowed = os.sched_getaffinity(0)
    one = {min(allowed)}
    ids, stop = [], threading.Event()

    def named(name: str) -> None:  # a thread with the OS name a library's thread would have
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write(name)
        ids.append(threading.get_native_id())
        stop.wait()

    threads = [threading.Thread(target=named, args=(n,)) for n in (IO_THREADS[0], "worker")]
    for thread in threads:
        thread.start()
    try:
        while len(ids) < len(threads):
            pass
        assert pin_process(one)
        assert release_io_threads() == 0  # not bound by pin_rank: nothing to release
        monkeypatch.setattr(affinity, "_bound", tuple(one))
        monkeypatch.setattr(affinity, "_unbound", tuple(sorted(allowed)))
        assert release_io_threads() >= 1
        io, worker = (os.sched_getaffinity(i) for i in sorted(ids, key=_name_order))
        assert io == allowed and worker == one and os.sched_getaffinity(0) == one
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        pin_process(allowed)


def _name_order(thread: int) -> int:
    with open(f"/proc/self/task/{thread}/comm") as comm:
        return 0 if comm.read().strip() in IO_THREADS else 1


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_usable_cores_are_the_cpus_the_process_may_run_on():
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})  # as under `taskset -c N`
        assert usable_cores() == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert usable_cores() == len(allowed)


@given(stages=st.lists(st.integers(0, 63), min_size=1, max_size=32, unique=True),
       cpus=st.sets(st.integers(0, 127), min_size=1, max_size=16))
def test_stage_threads_go_round_the_cores(stages, cpus):
    """One CPU each, of those given; stages next to each other on different ones when there
    are two or more; every CPU taken before any takes a second stage."""
    stages = sorted(stages)
    placed = stage_cores(stages, cpus)
    assert set(placed) == set(stages)
    assert all(len(c) == 1 and c[0] in cpus for c in placed.values())
    if len(cpus) > 1:
        assert all(placed[a] != placed[b] for a, b in zip(stages, stages[1:]))
    counts = [sum(placed[s] == (cpu,) for s in stages) for cpu in cpus]
    assert max(counts) - min(counts) <= 1
