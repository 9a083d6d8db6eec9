"""CPU affinity: each rank on a host computes on CPUs of its own."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AFFINITIES", "Host", "bind_io_threads", "choose_share", "core_share", "format_cpus",
           "hosts", "io_threads", "pin_process", "pin_rank", "ranks_on_host", "release_io_threads",
           "stage_cores", "usable_cores", "usable_cpus"]

AFFINITIES = ("auto", "none")
_bound: tuple[int, ...] | None = None  # this process's share, once pin_rank bound it
_unbound: tuple[int, ...] | None = None  # the CPUs it had before: its I/O threads' (below)
IO_THREADS = ("gloo_tcp_loop",)  # gloo's TCP event loops, one per process group
Host = tuple[str, bool, tuple[int, ...], bool]  # a rank's (host, on the CPU, CPUs, bound)


def core_share(local_rank: int, local_world: int, cpus: Sequence[int]) -> tuple[int, ...] | None:
    """The CPUs of `cpus` that local rank `local_rank` of `local_world` gets: an equal block of
    consecutive CPU numbers each (any remainder stays unused, so no rank gets more), or None
    when there are fewer CPUs than ranks."""
    cpus = sorted(cpus)
    if not 0 <= local_rank < local_world or local_world > len(cpus):
        return None
    width = len(cpus) // local_world
    return tuple(cpus[local_rank * width:(local_rank + 1) * width])


def choose_share(rank: int, everyone: Sequence[tuple[str, Any]]) -> tuple[int, ...] | None:
    """This rank's CPUs, from every rank's (host, CPUs it may use): its core_share among the
    ranks on its host, in rank order, when they may all use the same CPUs; None when they may
    not (a launcher placed them already) or there are fewer CPUs than ranks there."""
    host, allowed = everyone[rank]
    local = [r for r, (h, _) in enumerate(everyone) if h == host]
    if any(everyone[r][1] != allowed for r in local):
        return None
    return core_share(local.index(rank), len(local), allowed)


def stage_cores(stages: Sequence[int], cpus: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """The CPU each of `stages` (stage threads of one process, in pipeline order) is bound to
    where they outnumber `cpus`: the next one round, so neighbours, which hand each other
    their messages, compute on different cores (bound in blocks instead, the bundled VGG and
    ResNet stepped slower in 3 of 4 settings: benchmarks/thread_placement.py, ACCURACY.md)."""
    cpus = sorted(cpus)
    return {s: (cpus[i % len(cpus)],) for i, s in enumerate(stages)}


def pin_process(cpus: Sequence[int]) -> bool:
    """Bind every thread of this process to `cpus` (threads it starts later inherit the binding
    of the thread that starts them). False, and nothing bound, where this thread cannot be:
    no per-thread affinity or no /proc to list the threads (not Linux), or CPUs refused."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return False
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        return False
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # ended meanwhile, or not ours to bind
            os.sched_setaffinity(int(thread), cpus)
    return True


def pin_rank(device: str, affinity: str, everyone: Sequence[Host]) -> tuple[int, ...] | None:
    """With `affinity` "auto" and this rank on the CPU: bind every thread of this process but
    its I/O threads (release_io_threads) to its share of the host's CPUs (choose_share) and cap
    torch's intra-op threads at the share's size; return the share, or None when nothing was
    bound. "none" binds nothing (a binding the process has stays). A rank bound already keeps
    its share. `everyone`: every rank's `hosts()`, gathered before.

    Unbound, the OS moves the ranks' threads between cores and now and then runs two ranks on
    one, which slows their steps and makes their times jump from one stretch of steps to the
    next (benchmarks/rank_affinity.py)."""
    global _bound, _unbound
    if affinity == "none" or not hasattr(os, "sched_getaffinity"):
        return None
    if not str(device).startswith("cpu"):
        return None
    rank = dist.get_rank()
    # ranks bound by an earlier compile agree on "bound", whatever their shares
    share = _bound if everyone[rank][3] else choose_share(
        rank, [(host, "bound" if bound else cpus) for host, _, cpus, bound in everyone])
    before = usable_cpus()
    if share is None or not pin_process(share):
        return None
    _bound, _unbound = share, _unbound or before
    release_io_threads()
    torch.set_num_threads(min(torch.get_num_threads(), len(share)))
    return share


def release_io_threads() -> int:
    """Let the I/O threads (IO_THREADS) of a process pin_rank bound run on every CPU it had
    before, as they did; how many there are (0 where it bound nothing). Call it after making a
    process group, whose threads start with the binding of the thread that makes it.

    Bound to the rank's one core, the thread that takes a message in competes with the stage's
    compute for it: the compute it lands in ran longer than with that thread free to use the
    other core (benchmarks/landing_cost.py), and the MLP's steps took longer
    (benchmarks/io_threads.py, ACCURACY.md)."""
    if _bound is None or _unbound is None:
        return 0
    return bind_io_threads(_unbound)


def bind_io_threads(cpus: Iterable[int]) -> int:
    """Bind this process's I/O threads (io_threads) to `cpus`; how many there were."""
    threads = io_threads()
    for thread in threads:
        with contextlib.suppress(OSError):  # ended meanwhile
            os.sched_setaffinity(thread, cpus)
    return len(threads)


def io_threads() -> list[int]:
    """The ids of this process's I/O threads (IO_THREADS); none where /proc does not list
    threads (not Linux)."""
    if not os.path.isdir("/proc/self/task"):
        return []
    found = []
    for thread in os.listdir("/proc/self/task"):
        # a thread that ended meanwhile has no name to read
        with contextlib.suppress(OSError), open(f"/proc/self/task/{thread}/comm") as name:
            if name.read().strip() in IO_THREADS:
                found.append(int(thread))
    return found


def format_cpus(cpus: Sequence[int]) -> str:
    """CPU numbers as ranges: (0, 1, 2, 3, 8) -> "0-3,8"."""
    parts: list[list[int]] = []
    for cpu in sorted(cpus):
        if parts and cpu == parts[-1][-1] + 1:
            parts[-1].append(cpu)
        else:
            parts.append([cpu])
    return ",".join(f"{p[0]}-{p[-1]}" if len(p) > 2 else ",".join(map(str, p)) for p in parts)


def usable_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on, ascending: its affinity (taskset, a cpuset, a rank's
    share), else as many as the host has, numbered from 0."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many CPUs this process may run on (usable_cpus)."""
    return len(usable_cpus())


def ranks_on_host(rank: int, everyone: Sequence[Sequence[Any]]) -> tuple[int, int]:
    """From every rank's (host, whether it computes on the CPU, CPUs it may use, ...): how many
    ranks compute on the CPU of `rank`'s host, and how many CPUs the ranks there may use
    between them."""
    host = everyone[rank][0]
    here = [(on_cpu, cpus) for h, on_cpu, cpus, *_ in everyone if h == host]
    return sum(on_cpu for on_cpu, _ in here), len(set().union(*(cpus for _, cpus in here)))


def hosts(device: str) -> list[Host]:
    """Every rank's (host, whether it computes on the CPU, CPUs it may use, whether pin_rank
    bound it already), for pin_rank and ranks_on_host: what a rank cannot see by itself. Every
    rank of the job must call it. Ranks bound by an earlier compile give their shares, whose
    union is as many CPUs as ranks or more: pin_rank binds nothing where there are fewer."""
    allowed = usable_cpus()
    mine = (socket.gethostname(), torch.device(device).type == "cpu", allowed,
            allowed == _bound)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone
