"""CPU memory: the C allocator keeps what the process frees for its next allocations."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence

import torch

__all__ = ["CPU_MEMORY", "describe", "keep_for", "keep_freed_memory", "kept"]

CPU_MEMORY = ("keep", "system")

# glibc's mallopt parameters (malloc.h) and the settings "keep" gives them
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_SETTINGS = (
    (_M_MMAP_THRESHOLD, 32 << 20),  # glibc's ceiling on 64-bit: blocks below it come from the heap
    (_M_TRIM_THRESHOLD, 2 ** 31 - 1),  # the heap's free top is not handed back
    (_M_TOP_PAD, 64 << 20),  # the heap grows in large steps, not one system call a tensor
)
_kept = False


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory this process frees for its next allocations: blocks
    up to 32 MiB always come from the heap, and the heap never shrinks. As it comes, glibc
    gives a large block a mapping of its own until freeing one raises that threshold, and
    hands the free top of a heap back to the system beyond another; a training step frees and
    allocates the same tensors again and again, and memory handed back must be faulted in
    afresh, which a virtual machine makes costly (benchmarks/cpu_memory.py). The process then
    holds on to its peak memory. Returns whether the allocator keeps freed memory now; False,
    with nothing changed, where malloc is not glibc's (another C library, or an allocator
    such as jemalloc or tcmalloc preloaded). A setting glibc refused leaves the ones before
    it set."""
    global _kept
    if _kept:
        return True
    libc = _glibc()
    if libc is None:
        return False
    results = [libc.mallopt(parameter, value) for parameter, value in _SETTINGS]
    _kept = all(result == 1 for result in results)
    return _kept


def keep_for(asked: str, devices: Sequence[str | torch.device]) -> bool:
    """What compile does with Plan(cpu_memory=`asked`) for stages on `devices`, before it times
    anything: keep_freed_memory() when "keep" and a stage is on the CPU. Returns kept()."""
    if asked == "keep" and any(torch.device(d).type == "cpu" for d in devices):
        keep_freed_memory()
    return kept()


def kept() -> bool:
    """Whether keep_freed_memory() set this process's allocator."""
    return _kept


def describe(asked: str) -> str | None:
    """One line on this process's handling of freed CPU memory for a plan that asked for
    `asked` ("keep" or "system"), or None when there is nothing to say (left as it was)."""
    if kept():
        if asked == "keep":
            return "CPU memory: freed memory kept for reuse (Plan(cpu_memory='keep'))"
        return ("CPU memory: freed memory kept for reuse, as an earlier compile in this process "
                "set it (it lasts as long as the process)")
    if asked == "keep":
        return ("CPU memory: as the allocator handles it (Plan(cpu_memory='keep') needs "
                "glibc's malloc)")
    return None


def _glibc() -> ctypes.CDLL | None:
    """glibc, when it is the C library and its malloc the process's; else None."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    if not version or not version.startswith("glibc"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    process = ctypes.CDLL(None)  # the malloc calls resolve to: a preloaded one comes first
    if _address(process.malloc) != _address(libc.malloc):
        return None
    return libc


def _address(function: ctypes._CFuncPtr) -> int | None:
    return ctypes.cast(function, ctypes.c_void_p).value
