"""Transports move a micro-batch's values between stages; LocalTransport does it in one process.

A send never waits for its receiver (the schedules are lowered for posted sends); a receive
blocks until the message is there, the run is aborted, or the timeout passes. Messages are
keyed by (src, dst, direction, micro-batch), so their order on a link does not matter.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from fxpipe.errors import FxpipeError

__all__ = ["LocalTransport", "PipelineAborted", "Transport", "device_context"]

Key = tuple[int, int, str, Any]  # (src, dst, "F" or "B", micro-batch key)


def device_context(device: torch.device) -> contextlib.AbstractContextManager:
    """Make `device` the current CUDA device of this worker thread (nothing to do on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class PipelineAborted(FxpipeError):
    """Another stage failed, so this one stopped waiting."""


class Transport(Protocol):
    """What the driver needs to move a micro-batch's values between stages."""

    def send(self, src: int, dst: int, direction: str, mb: Any,
             values: Mapping[str, Any]) -> None: ...

    def recv(self, src: int, dst: int, direction: str, mb: Any) -> dict[str, Any]: ...

    def prefetch(self, src: int, dst: int, direction: str, mb: Any) -> None: ...

    def prepare(self, key: Any, sizes: Sequence[int], seq: int | None) -> None: ...

    def abort(self, error: BaseException) -> None: ...

    def reset(self) -> None: ...

    def flush(self) -> None: ...


class LocalTransport:
    """Stages in one process: a message is a dict of values handed over, copied to the
    receiver's device when it differs. On CUDA the copy runs on a side stream and the receiver's
    stream waits on an event, so copies overlap compute."""

    def __init__(self, devices: list[str], timeout: float = 300.0) -> None:
        self.devices = [torch.device(d) for d in devices]
        self.timeout = timeout
        self._messages: dict[Key, tuple[dict[str, Any], Any]] = {}
        # one condition per receiving stage, on one lock: a send wakes only its receiver (with
        # one condition for all, every send woke every waiting stage thread, which took the
        # interpreter lock and CPU from the stages computing)
        self._lock = threading.Lock()
        self._ready = [threading.Condition(self._lock) for _ in self.devices]
        self._error: BaseException | None = None
        self._copy_streams: dict[torch.device, Any] = {}

    def send(self, src: int, dst: int, direction: str, mb: Any,
             values: Mapping[str, Any]) -> None:
        payload, event = self._to_device(values, self.devices[dst])
        with self._lock:
            self._messages[(src, dst, direction, mb)] = (payload, event)
            self._ready[dst].notify_all()

    def recv(self, src: int, dst: int, direction: str, mb: Any) -> dict[str, Any]:
        key = (src, dst, direction, mb)
        with self._lock:
            self._wait_for([key])
            payload, event = self._messages.pop(key)
        if event is not None:  # CUDA: make the receiver's stream wait for the copy
            torch.cuda.current_stream(self.devices[dst]).wait_event(event)
        return payload

    def arrived(self, src: int, dst: int, direction: str, mb: Any) -> bool:
        """Whether the message is here, so that a recv of it would not wait."""
        with self._lock:
            return (src, dst, direction, mb) in self._messages

    def share_wakeups(self, groups: Sequence[Sequence[int]]) -> None:
        """The receiving stages of each group are woken together: a thread running several
        stages waits for the next message to any of them (`wait_for_any`)."""
        with self._lock:
            for group in groups:
                shared = threading.Condition(self._lock)
                for dst in group:
                    self._ready[dst] = shared

    def wait_for_any(self, keys: Sequence[Key]) -> None:
        """Block until one of the messages `keys` (src, dst, direction, micro-batch), all to
        stages woken together (`share_wakeups`), is here."""
        with self._lock:
            self._wait_for(keys)

    def _wait_for(self, keys: Sequence[Key]) -> None:
        """Wait, holding the lock, until one of `keys` is here; raise where the run was
        aborted or the timeout passed."""
        receivers = sorted({dst for _, dst, _, _ in keys})
        who = (f"stage {receivers[0]}" if len(receivers) == 1 else
               f"the thread running stages {', '.join(map(str, receivers))}")
        arrived = self._ready[receivers[0]].wait_for(
            lambda: any(k in self._messages for k in keys) or self._error, self.timeout)
        if self._error is not None:
            raise PipelineAborted(f"{who} stopped: {self._error}") from self._error
        if not arrived:
            waits = " or ".join(f"{direction} micro-batch {mb} from stage {src}"
                                + (f" to stage {dst}" if len(receivers) > 1 else "")
                                for src, dst, direction, mb in keys)
            raise FxpipeError(
                f"{who} waited {self.timeout:.0f} s for {waits}; the schedule's sends and "
                "receives do not match."
            )

    def abort(self, error: BaseException) -> None:
        """Wake every waiting receiver with `error`."""
        with self._lock:
            self._error = error
            for ready in self._ready:
                ready.notify_all()

    def reset(self) -> None:
        with self._lock:
            self._messages.clear()
            self._error = None

    def flush(self) -> None:
        """Sends complete when posted here."""

    def prepare(self, key: Any, sizes: Sequence[int], seq: int | None) -> None:
        """Messages here carry their own shapes."""

    def prefetch(self, src: int, dst: int, direction: str, mb: Any) -> None:
        """Messages here are handed over, not transferred: nothing to start early."""

    def measure_handoff(self, repeats: int = 50) -> tuple[float, float]:
        """(latency, post) of handing a message from one stage thread to another through this
        transport: `post`, the sender's seconds in send(); `latency`, the seconds beyond them
        until a receiver blocked in recv() has it (mostly waking the thread). Medians of
        a ping-pong between two threads, after as many warm-up round trips; it runs on its own
        message keys, so call it between runs."""
        sample = torch.zeros(1, device=self.devices[0])
        rounds = 2 * repeats
        one_way, posts, failed = [], [], []

        def pong() -> None:
            try:
                for i in range(rounds):
                    self.send(1, 0, "B", ("handoff", i), self.recv(0, 1, "F", ("handoff", i)))
            except BaseException as error:  # re-raised below: a silent failure would hang ping
                failed.append(error)
                self.abort(error)

        worker = threading.Thread(target=pong, name="fxpipe-handoff", daemon=True)
        worker.start()
        try:
            for i in range(rounds):
                start = time.perf_counter()
                self.send(0, 1, "F", ("handoff", i), {"value": sample})
                posted = time.perf_counter()
                self.recv(1, 0, "B", ("handoff", i))
                if i >= repeats:
                    posts.append(posted - start)
                    one_way.append((time.perf_counter() - start) / 2)
        except BaseException as error:  # wake the other thread, which may wait for a message
            self.abort(error)
            raise
        finally:
            worker.join()
            self.reset()
        if failed:
            raise failed[0]
        post = statistics.median(posts)
        return max(statistics.median(one_way) - post, 0.0), post

    def _to_device(self, values: Mapping[str, Any], device: torch.device):
        moved, event = {}, None
        for name, value in values.items():
            if not isinstance(value, torch.Tensor) or value.device == device:
                moved[name] = value
            elif device.type == "cuda" and value.device.type == "cuda":
                stream = self._copy_stream(device)
                stream.wait_stream(torch.cuda.current_stream(value.device))
                with torch.cuda.stream(stream):
                    moved[name] = value.to(device, non_blocking=True)
                    value.record_stream(stream)
                event = torch.cuda.Event()
                event.record(stream)
            else:
                moved[name] = value.to(device)
        return moved, event

    def _copy_stream(self, device: torch.device):
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device)
        return self._copy_streams[device]
