"""The timeline's clock per device: the host's perf_counter, or CUDA events on a GPU's stream."""

from __future__ import annotations

import time
from typing import Any

import torch

from fxpipe.devices import timer_kind

__all__ = ["CudaEventClock", "HostClock", "action_clock"]


class HostClock:
    """Seconds on the host since `origin` (a perf_counter reading): work the host runs."""

    def __init__(self, origin: float) -> None:
        self.origin = origin

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, mark: float) -> float:
        return mark - self.origin


class CudaEventClock:
    """Seconds on a GPU's current stream since the clock was made: each mark is an event
    recorded on the stream, so a span is the kernels' time, not their launch. Reading a mark
    waits for it (once per run, after the run's work is queued), which also makes the run's
    wall time the kernels'. `cuda` is torch.cuda (a test passes a fake)."""

    def __init__(self, device: torch.device, origin: float, cuda: Any = None) -> None:
        self.cuda = cuda if cuda is not None else torch.cuda
        self.device = device
        # the host's time when the stream reached the origin: the host's clock and the
        # stream's agree there (an idle stream reaches it at once)
        self.offset = time.perf_counter() - origin
        self.origin = self.mark()

    def mark(self) -> Any:
        event = self.cuda.Event(enable_timing=True)
        event.record(self.cuda.current_stream(self.device))
        return event

    def seconds(self, mark: Any) -> float:
        mark.synchronize()
        return self.offset + self.origin.elapsed_time(mark) / 1e3


def action_clock(device: torch.device, origin: float, cuda: Any = None
                 ) -> HostClock | CudaEventClock:
    """The clock that times a stage's actions on `device` (fxpipe.devices.timer_kind)."""
    if timer_kind(device) == "cuda-events":
        return CudaEventClock(device, origin, cuda)
    return HostClock(origin)
