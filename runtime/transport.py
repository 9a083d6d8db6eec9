"""Transports move a micro-batch's values between stages; LocalTransport does it in one process."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch.utils import _pytree as pytree

from fxpipe.devices import copy_route, should_pin
from fxpipe.errors import FxpipeError

__all__ = ["CudaOps", "DeviceCopies", "LocalTransport", "MicroBatchKey", "PipelineAborted",
           "Transport", "device_context", "to_device"]


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
    is aborted, or the timeout passes. `delivered` says a message sent has surely been received
    (its send may complete now, without waiting); `flush`, at a run's end, completes the rest.
    Messages are keyed by (src, dst, direction, micro-batch), so their order on a link does not
    matter.
    """

    def send(self, src: int, dst: int, direction: str, key: MicroBatchKey,
             values: Mapping[str, Any]) -> None: ...

    def recv(self, src: int, dst: int, direction: str, key: MicroBatchKey) -> dict[str, Any]: ...

    def prefetch(self, src: int, dst: int, direction: str, key: MicroBatchKey) -> None: ...

    def delivered(self, src: int, dst: int, direction: str, key: MicroBatchKey) -> None: ...

    def prepare(self, run: Any, sizes: Sequence[int], seq: int | None) -> None: ...

    def abort(self, error: BaseException) -> None: ...

    def reset(self) -> None: ...

    def flush(self) -> None: ...


class LocalTransport:
    """Stages in one process: a message is a dict of values handed over, copied to the
    receiver's device when it differs (by DeviceCopies: on CUDA on a side stream the
    receiver's stream waits on, so copies overlap compute)."""

    def __init__(self, devices: Sequence[str], timeout: float = 300.0) -> None:
        self.devices = [torch.device(d) for d in devices]
        self.timeout = timeout
        self._messages: dict[Message, tuple[dict[str, Any], Any]] = {}
        # one condition per receiving stage, on one lock: a send wakes only its receiver, not
        # every waiting stage thread (which would take the interpreter lock from the others)
        self._lock = threading.Lock()
        self._ready = [threading.Condition(self._lock) for _ in self.devices]
        self._error: BaseException | None = None
        self.copies = DeviceCopies()

    def send(self, src: int, dst: int, direction: str, key: MicroBatchKey,
             values: Mapping[str, Any]) -> None:
        payload, arrival = self.copies.move(values, self.devices[dst])
        with self._lock:
            self._messages[(src, dst, direction, key)] = (payload, arrival)
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
            payload, arrival = self._messages.pop(message)
        self.copies.wait(arrival, self.devices[dst])  # on the receiver's thread and stream
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

    def delivered(self, src: int, dst: int, direction: str, key: MicroBatchKey) -> None:
        """A receive takes its message: nothing of it stays behind to release."""


class CudaOps:
    """The CUDA calls DeviceCopies makes, in one place (a test substitutes recording fakes,
    so every route runs on a machine without a GPU)."""

    def copy_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def event(self) -> Any:
        return torch.cuda.Event()

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def copy(self, tensor: torch.Tensor, device: torch.device, non_blocking: bool
             ) -> torch.Tensor:
        return tensor.to(device, non_blocking=non_blocking)

    def record(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class Arrival(NamedTuple):
    """What a receiver waits for before it uses moved values: (event, "stream" | "host")
    per copy stream used, and the copies made on a CUDA device (their memory is then in use
    on the receiver's stream, not only the copy stream's)."""

    events: list[tuple[Any, str]]
    landed: list[torch.Tensor]


NOTHING = Arrival([], [])


class DeviceCopies:
    """Moves values (any nesting of tensors) onto a device by their CopyRoute
    (fxpipe.devices.copy_route): host tensors through pinned memory, CUDA copies on the copy
    stream of the device that is the GPU end, after the source's stream, with an event per
    stream the receiver waits on (`wait`). A value already on the device is handed over."""

    def __init__(self, ops: Any = None) -> None:
        self.ops = ops if ops is not None else CudaOps()
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()  # senders on several worker threads

    def move(self, values: Mapping[str, Any], device: torch.device
             ) -> tuple[dict[str, Any], Arrival]:
        leaves, spec = pytree.tree_flatten(dict(values))
        events: dict[torch.device, Any] = {}
        waits: dict[torch.device, str] = {}
        landed = []
        moved = []
        for value in leaves:
            route = copy_route(value.device, device) if isinstance(value, torch.Tensor) \
                else None
            if route is None:
                moved.append(value)
            elif route.stream == "current":
                moved.append(self.ops.copy(value, device, False))
            else:
                gpu_end = device if device.type == "cuda" else value.device
                stream = self._copy_stream(gpu_end)
                if value.device.type == "cuda":  # the copy reads what the source's stream wrote
                    stream.wait_stream(self.ops.current_stream(value.device))
                source = self.ops.pin(value) if should_pin(value, device) else value
                with self.ops.use_stream(stream):
                    copy = self.ops.copy(source, device, route.non_blocking)
                if value.device.type == "cuda":  # not reused before the copy stream read it
                    self.ops.record(value, stream)
                if device.type == "cuda":
                    landed.append(copy)
                events[gpu_end], waits[gpu_end] = stream, route.wait
                moved.append(copy)
        arrival = NOTHING
        if events:
            recorded = []
            for gpu_end, stream in events.items():
                event = self.ops.event()
                event.record(stream)
                recorded.append((event, waits[gpu_end]))
            arrival = Arrival(recorded, landed)
        return pytree.tree_unflatten(moved, spec), arrival

    def wait(self, arrival: Arrival, device: torch.device) -> None:
        """Make the receiver on `device` (this thread) wait for the copies of `arrival`."""
        stream = None
        for event, how in arrival.events:
            if how == "stream":
                stream = self.ops.current_stream(device)
                stream.wait_event(event)
            elif how == "host":
                event.synchronize()
        if stream is not None:
            for tensor in arrival.landed:  # freed only once the receiver's stream used it
                self.ops.record(tensor, stream)

    def _copy_stream(self, device: torch.device) -> Any:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = self.ops.copy_stream(device)
            return self._streams[device]


def to_device(values: Mapping[str, Any], device: torch.device,
              copies: DeviceCopies | None = None) -> dict[str, Any]:
    """`values` on `device`, ready for this thread's stream (the inputs of the first stage,
    the target of the last)."""
    copies = copies or DeviceCopies()
    moved, arrival = copies.move(values, device)
    copies.wait(arrival, device)
    return moved
