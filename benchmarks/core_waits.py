"""Benchmark: the waits for a core that unit timings leave out, read as fxpipe reads them or not.

With more stage threads than cores, compile times each unit beside every other stage busy and
leaves out what the timing thread waited for a core: the difference of two reads of Linux's
schedstat, before and after the call, which fxpipe reads through Python's file objects. Such a
read lets the interpreter lock go around each of its system calls, and taking the lock back
from the busy threads can make the thread wait for a core outside the timed call: the
difference counts that wait too. This script asks how much of what is left out is such a wait,
and what the prediction makes of the units timed without it.

It compiles a bundled model into `--stages` stage threads and, in each of `--rounds` rounds,
measures the link and the runtime's own time, re-times the units twice (`fxpipe.retime`, in
turns which first): reading the waits as fxpipe does ("file"), and from one open file per
thread read by a call that keeps the lock ("kept lock", libc's pread through ctypes.PyDLL);
then it runs untimed steps for 0.2 s and timed ones for `--seconds`. It prints how many calls
of the timer each read left at 0 (a wait at least as long as the call; the warm-up's, the fused
forwards' and the loss's count too), the median wait each took off a call, and per round each
read's predicted step beside the median measured one. The prediction is made as `fxpipe bench`
makes it, but for the units timed for `--min-time` seconds per micro-batch size (compile's, by
default; the bench's rounds time them for its PROFILE_SECONDS since 37c6fc7).

    OMP_NUM_THREADS=1 python benchmarks/core_waits.py --model mlp --stages 4 --rounds 6
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import threading
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from two_stages import add_stage_thread_arguments, in_stage_threads, median_step

import fxpipe
from fxpipe.affinity import usable_cores
from fxpipe.passes.analysis import profile

READS = ("file", "kept lock")
SCHEDSTAT = "/proc/thread-self/schedstat"


class LockKeepingRead:
    """The calling thread's seconds waiting for a core so far, from its schedstat file opened
    once per thread and read by libc's pread through ctypes.PyDLL, whose calls keep the lock."""

    def __init__(self) -> None:
        self.pread = ctypes.PyDLL(None, use_errno=True).pread
        self.pread.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_long]
        self.pread.restype = ctypes.c_ssize_t
        self.threads = threading.local()

    def __call__(self) -> float:
        if not hasattr(self.threads, "fd"):  # opening lets the lock go: before any reading
            self.threads.fd = os.open(SCHEDSTAT, os.O_RDONLY)  # the opening thread's file
            self.threads.buffer = ctypes.create_string_buffer(128)
        count = self.pread(self.threads.fd, self.threads.buffer, 128, 0)
        if count <= 0:
            raise OSError(ctypes.get_errno(), f"could not read {SCHEDSTAT}")
        return int(self.threads.buffer.raw[:count].split()[1]) / 1e9


class WaitNotingTimer:
    """profile's timer, noting each call's seconds once the wait is taken off, and the wait,
    from the readings of the `_core_wait` it is given (two per call: before and after)."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []  # (seconds kept, wait taken off)
        self.readings: list[float] = []
        self.timer = profile._timer

    def reading(self, read: Callable[[], float]) -> Callable[[], float]:
        def noted() -> float:
            self.readings.append(read())
            return self.readings[-1]
        return noted

    def __call__(self, device: torch.device, core_waits_out: bool = False
                 ) -> Callable[..., tuple[Any, float]]:
        timer = self.timer(device, core_waits_out)
        if not core_waits_out:
            return timer

        def noting(fn, *args, **kwargs):
            before = len(self.readings)
            result, seconds = timer(fn, *args, **kwargs)
            if len(self.readings) != before + 2:
                raise RuntimeError(f"profile's timer read the wait for a core "
                                   f"{len(self.readings) - before} times in a call, not twice: "
                                   "this script pairs the readings as it no longer does")
            self.calls.append((seconds, self.readings[-1] - self.readings[-2]))
            return result, seconds
        return noting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_stage_thread_arguments(parser, rounds=6)
    parser.add_argument("--seconds", type=float, default=0.5, help="of timed steps per round")
    args = parser.parse_args()
    cores = usable_cores()
    if args.stages <= cores:
        parser.error(f"--stages {args.stages}: the units' timings leave the waits for a core "
                     f"out only with more stage threads than this machine's {cores} cores")
    if not profile._core_waits_known():
        parser.error(f"this kernel does not count a thread's waits for a core ({SCHEDSTAT})")
    pipe, x, y = in_stage_threads(args)
    recorder = WaitNotingTimer()
    reads = {"file": profile._core_wait, "kept lock": LockKeepingRead()}
    calls: dict[str, list[tuple[float, float]]] = {read: [] for read in READS}
    ratios: dict[str, list[float]] = {read: [] for read in READS}
    print(f"{args.model}, {args.stages} stage threads on {cores} cores, {args.partitioner} "
          f"{'+'.join(map(str, pipe.partition.sizes))}, {args.schedule}, "
          f"{args.micro_batches} micro-batches; predicted / measured step, ms")
    with mock.patch.object(profile, "_timer", recorder):
        for index in range(args.rounds):
            pipe.measure_link(x)
            pipe.measure_runtime_overhead(x)
            predicted = {}
            for read in READS if index % 2 == 0 else READS[::-1]:
                recorder.calls = []
                with mock.patch.object(profile, "_core_wait", recorder.reading(reads[read])):
                    fresh = fxpipe.retime(pipe, (x,), target=y, warmup=1,
                                          min_time=args.min_time)
                calls[read] += recorder.calls
                predicted[read] = pipe.predicted_timeline(fresh).makespan + pipe.step_overhead
            measured = median_step(pipe, x, y, steps=3, seconds=args.seconds)
            cells = []
            for read in READS:
                ratios[read].append(measured / predicted[read])
                cells.append(f"{read} {predicted[read] * 1e3:.2f} ({ratios[read][-1]:.2f})")
            print(f"round {index}: measured {measured * 1e3:.2f}; predicted " + ", ".join(cells)
                  + "; in brackets measured / predicted")
    if not calls[READS[0]]:
        raise SystemExit("the units were not timed with the waits for a core left out (a model "
                         "on the meta device, or not on the CPU): nothing to compare")
    for read in READS:
        kept, waits = zip(*calls[read])
        zeros = sum(seconds == 0 for seconds in kept)
        print(f"{read}: {zeros} of {len(kept)} timed calls left at 0, median wait taken off "
              f"{statistics.median(waits) * 1e6:.0f} us; measured / predicted "
              f"{min(ratios[read]):.2f} to {max(ratios[read]):.2f}, "
              f"median {statistics.median(ratios[read]):.2f}")


if __name__ == "__main__":
    main()
