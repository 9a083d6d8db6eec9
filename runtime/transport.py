"""Transports move a micro-batch's values between stages; LocalTransport does it in one process."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from fxpipe.errors import FxpipeError

__all__ = ["LocalTransport", "MicroBatchKey", "PipelineAborted", "Transport", "device_context"]


class MicroBatchKey(NamedTuple):
    """One micro-batch of one run: what the runtime keys the values it holds and moves by."""

    run: Any  # the run's own key: a forward now and its backward later are one run
    mb: int  # the micro-batch's index in the schedule (Action.mb)


Message = tuple[int, int, str, MicroBatchKey]  # (src, dst, "F" or "B", micro-batch)


def device_context(device: torch.device) -> contextlib.AbstractContextManager:
    """Make `device` the current CUDA device of this worker thread (nothing to do on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class PipelineAborted(FxpipeError):
    """Another stage failed, so this one stopped waiting."""


class Transport(Protocol):
    """What the driver needs to move a micro-batch's values between stages.

    A send never waits for its receiver; a receive blocks until the message is there, the run
    is aborted, or the timeout passes. Messages are keyed by (src, dst, direction, micro-batch),
    so their order on a link does not matter.
    """

    def send(self, src: int, dst: int, direction: str, key: MicroBatchKey,
             values: Mapping[str, Any]) -> None: ...

    def recv(self, src: int, dst: int, direction: str, key: MicroBatchKey) -> dict[str, Any]: ...

    def prefetch(self, src: int, dst: int, direction: str, key: MicroBatchKey) -> None: ...

    def prepare(self, run: Any, sizes: Sequence[int], seq: int | None) -> None: ...

    def abort(self, error: BaseException) -> None: ...

    def reset(self) -> None: ...

    def flush(self) -> None: ...


class LocalTransport:
    """Stages in one process: a message is a dict of values handed over, copied to the
    receiver's device when it differs. On CUDA the copy runs on a side stream and the receiver's
    stream waits on an event, so copies overlap compute."""

    def __init__(self, devices: Sequence[str], timeout: float = 300.0) -> None:
        self.devices = [torch.device(d) for d in devices]
        self.timeout = timeout
        self._messages: dict[Message, tuple[dict[str, Any], Any]] = {}
        # one condition per receiving stage, on one lock: a send wakes only its receiver, not
        # every waiting stage thread (which would take the interpreter lock from the others)
        self._lock = threading.Lock()
        self._ready = [threading.Condition(self._lock) for _ in self.devices]
        self._error: BaseException | None = None
        self._copy_streams: dict[torch.device, Any] = {}

    def send(self, src: int, dst: int, direction: str, key: MicroBatchKey,
             values: Mapping[str, Any]) -> None:
        payload, event = self._to_device(values, self.devices[dst])
        with self._lock:
            self._messages[(src, dst, direction, key)] = (payload, event)
            self._ready[dst].notify_all()

    def recv(self, src: int, dst: int, direction: str, key: MicroBatchKey) -> dict[str, Any]:
        message = (src, dst, direction, key)
        with self._lock:
            arrived = self._ready[dst].wait_for(
                lambda: message in self._messages or self._error is not None, self.timeout)
            if self._error is not None:
                raise PipelineAborted(f"stage {dst} stopped: {self._error}") from self._error
            if not arrived:
                raise FxpipeError(
                    f"stage {dst} waited {self.timeout:g} s for {direction} micro-batch "
                    f"{key.mb} from stage {src}: a stage is stuck, or the schedule's sends and "
                    "receives do not match (Plan(timeout=...) sets how long a stage waits).")
            payload, event = self._messages.pop(message)
        if event is not None:  # CUDA: make the receiver's stream wait for the copy
            torch.cuda.current_stream(self.devices[dst]).wait_event(event)
        return payload

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

    def prepare(self, run: Any, sizes: Sequence[int], seq: int | None) -> None:
        """Messages here carry their own shapes."""

    def prefetch(self, src: int, dst: int, direction: str, key: MicroBatchKey) -> None:
        """Messages here are handed over, not transferred: nothing to start early."""

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
