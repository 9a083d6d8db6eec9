"""Peak memory of labelled spans of work: CUDA's allocator statistics, torch.profiler on the CPU.

A span's peak is the most memory allocated while it ran above what was allocated when it
started: its outputs, what autograd saves, and transient workspace. On CUDA the caching
allocator keeps that statistic; on the CPU nothing does, so one `torch.profiler` session with
memory profiling logs every allocation and free, and the running sum gives each span's peak.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["PeakMemory"]

_PREFIX = "fxpipe.peak."


class PeakMemory:
    """Measure the peak allocation of named spans: `with peaks.span(name): ...` inside
    `with peaks:`; read `peaks.result[name]` (bytes) after the block. A span run twice keeps
    its larger peak. When another profiler is already running on the CPU, the CPU cannot be
    measured here and every result is NaN."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.result: dict[str, float] = {}
        self._profiler: profile | None = None
        self._cuda = self.device.type == "cuda"

    def __enter__(self) -> PeakMemory:
        if not self._cuda and not torch.autograd.profiler._is_profiler_enabled:  # no nesting
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _quiet_profiler():
                self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._profiler is None:
            return
        with _quiet_profiler():
            self._profiler.__exit__(*exc)
        self._read_cpu_peaks(self._profiler.profiler.kineto_results.events())

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        if self._cuda:
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self._keep(name, float(torch.cuda.max_memory_allocated(self.device) - base))
        elif self._profiler is None:
            yield
            self._keep(name, float("nan"))
        else:
            with record_function(_PREFIX + name):
                yield

    def _keep(self, name: str, peak: float) -> None:
        self.result[name] = max(self.result.get(name, peak), peak)

    def _read_cpu_peaks(self, events) -> None:
        allocations = sorted((e.start_ns(), e.nbytes()) for e in events
                             if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
        times = np.array([t for t, _ in allocations], dtype=np.int64)
        level = np.cumsum([n for _, n in allocations], dtype=np.float64)
        for event in events:
            if not event.name().startswith(_PREFIX):
                continue
            first = np.searchsorted(times, event.start_ns(), side="left")
            last = np.searchsorted(times, event.end_ns(), side="right")
            base = level[first - 1] if first > 0 else 0.0
            peak = float(level[first:last].max() - base) if last > first else 0.0
            self._keep(event.name()[len(_PREFIX):], max(peak, 0.0))


@contextlib.contextmanager
def _quiet_profiler() -> Iterator[None]:
    """Kineto, the profiler's backend, prints a line on every start and stop that would land in
    the middle of a user's output; its log level is read on each call, so raise it meanwhile
    (6 silences everything) and put the user's setting back."""
    previous = os.environ.get("KINETO_LOG_LEVEL")
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["KINETO_LOG_LEVEL"]
        else:
            os.environ["KINETO_LOG_LEVEL"] = previous
