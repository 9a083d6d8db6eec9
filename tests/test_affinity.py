"""CPU affinity: the ranks on a host get disjoint, equal shares of its CPUs."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fxpipe.affinity
from fxpipe.affinity import core_share, pin_rank


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
    for share in shares:  # neighbours in the allowed set, not scattered
        first = ordered.index(share[0])
        assert list(share) == ordered[first:first + len(share)]


def test_a_rank_outside_its_world_gets_nothing():
    assert core_share(2, 2, [0, 1, 2, 3]) is None
    assert core_share(-1, 2, [0, 1]) is None


def test_only_cpu_ranks_started_by_torchrun_are_bound(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert pin_rank("cpu", "auto") is None  # not started by torchrun: the launcher decides
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert pin_rank("cpu", "none") is None
    assert pin_rank("cuda:0", "auto") is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10 ** 6))  # more ranks than CPUs
    assert pin_rank("cpu", "auto") is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no per-thread affinity here")
def test_a_lone_rank_is_bound_to_every_cpu_it_may_use(monkeypatch):
    allowed = os.sched_getaffinity(0)
    monkeypatch.setattr(fxpipe.affinity, "_bound", [])  # this process's binding stays its own
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    try:
        assert pin_rank("cpu", "auto") == tuple(sorted(allowed))
        assert os.sched_getaffinity(0) == allowed
    finally:
        os.sched_setaffinity(0, allowed)
