"""CPU affinity: each rank on a host computes on cores of its own."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["AFFINITIES", "core_share", "pin_process", "pin_rank"]

AFFINITIES = ("auto", "none")
_bound: list[tuple[int, ...]] = []  # the share this process was bound to, once it was


def core_share(local_rank: int, local_world: int, cpus: Sequence[int]) -> tuple[int, ...] | None:
    """The CPUs of `cpus` that local rank `local_rank` of `local_world` gets: an equal block of
    neighbours each (any remainder stays unused, so no rank gets more), or None when there are
    fewer CPUs than ranks."""
    cpus = sorted(cpus)
    if not 0 <= local_rank < local_world or local_world > len(cpus):
        return None
    width = len(cpus) // local_world
    return tuple(cpus[local_rank * width:(local_rank + 1) * width])


def pin_process(cpus: Sequence[int]) -> bool:
    """Bind every thread of this process to `cpus` (threads it starts later inherit the binding
    of the thread that starts them). False where the OS cannot (no per-thread affinity, or no
    /proc to list the threads)."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return False
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), cpus)
        except (ProcessLookupError, PermissionError):  # ended meanwhile, or not ours to bind
            continue
    return True


def pin_rank(device: str, affinity: str) -> tuple[int, ...] | None:
    """Under torchrun on the CPU, with `affinity` "auto": bind this rank to its share of the
    CPUs it may use (core_share by LOCAL_RANK and LOCAL_WORLD_SIZE) when every rank on the host
    gets at least one; return those CPUs, or None when nothing was bound. Unbound, the
    scheduler moves the ranks' threads between cores and now and then runs two ranks on one,
    which makes their steps slower and their times jump from one stretch of steps to the
    next (benchmarks/rank_affinity.py)."""
    if affinity == "none" or not str(device).startswith("cpu") \
            or not hasattr(os, "sched_getaffinity"):
        return None
    try:
        local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):  # not started by torchrun: the launcher decides
        return None
    allowed = os.sched_getaffinity(0)
    if _bound and set(_bound[0]) == allowed:  # a later pipeline of a rank bound already
        share: tuple[int, ...] | None = _bound[0]
    else:
        share = core_share(local_rank, local_world, allowed)
    if share is None or not pin_process(share):
        return None
    _bound[:] = [share]
    return share
