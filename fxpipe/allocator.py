"""CPU memory: the C allocator keeps what the process frees for its next allocations."""

from __future__ import annotations

import ctypes
import os

__all__ = ["CPU_MEMORY", "keep_freed_memory", "kept"]

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
    up to 32 MiB come from the heap, not each from a mapping of its own, and the heap does not
    shrink. A training step frees and allocates the same tensors again and again; memory given
    back to the system must be mapped and faulted in afresh every time, which a virtual
    machine makes costly (benchmarks/cpu_memory.py). The process then holds on to its peak
    memory. Returns whether the allocator keeps freed memory now; False where the C library
    is not glibc (nothing is changed)."""
    global _kept
    if _kept:
        return True
    libc = _glibc()
    if libc is None:
        return False
    _kept = all(libc.mallopt(parameter, value) == 1 for parameter, value in _SETTINGS)
    return _kept


def kept() -> bool:
    """Whether keep_freed_memory() set this process's allocator."""
    return _kept


def _glibc() -> ctypes.CDLL | None:
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    if not version or not version.startswith("glibc"):
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") else None
