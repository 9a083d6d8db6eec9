"""Copies between devices, the timeline's clocks and the device wiring, run without a GPU: the CUDA
calls go to recording fakes and GPU tensors are meta tensors that say they are on a GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe.runtime import coordinator, driver, executor
from fxpipe.runtime.clock import CudaEventClock, HostClock, action_clock
from fxpipe.runtime.transport import DeviceCopies, LocalTransport, MicroBatchKey, device_context


class OnGpu(torch.Tensor):
    """A meta tensor that reports a CUDA device (set per instance)."""

    @property
    def device(self) -> torch.device:
        return self._gpu


def on_gpu(index: int, *shape: int) -> torch.Tensor:
    tensor = torch.Tensor._make_subclass(OnGpu, torch.empty(*shape, device="meta"))
    tensor._gpu = torch.device("cuda", index)
    return tensor


class Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: Stream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: Event) -> None:
        self.log.append(("wait_event", self.name, event.name))


class Event:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def record(self, stream: Stream) -> None:
        self.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class FakeCudaOps:
    """DeviceCopies' CUDA calls, logged; a copy is a meta tensor on the destination."""

    def __init__(self) -> None:
        self.log: list = []
        self.current: Stream | None = None
        self.events = 0

    def copy_stream(self, device):
        self.log.append(("new_stream", str(device)))
        return Stream(f"copy:{device}", self.log)

    def current_stream(self, device):
        return Stream(f"current:{device}", self.log)

    @contextlib.contextmanager
    def use_stream(self, stream):
        self.current = stream
        yield
        self.current = None

    def event(self):
        self.events += 1
        return Event(f"e{self.events}", self.log)

    def pin(self, tensor):
        self.log.append(("pin", tuple(tensor.shape)))
        return tensor

    def copy(self, tensor, device, non_blocking):
        on = self.current.name if self.current else "caller"
        self.log.append(("copy", str(device), non_blocking, on))
        return on_gpu(device.index or 0, *tensor.shape) if device.type == "cuda" else \
            torch.empty(tensor.shape)

    def record(self, tensor, stream):
        self.log.append(("record_stream", str(tensor.device), stream.name))


def test_host_to_gpu_is_pinned_and_asynchronous_on_the_copy_stream():
    ops = FakeCudaOps()
    copies = DeviceCopies(ops)
    gpu = torch.device("cuda:0")
    moved, arrival = copies.move({"x": torch.ones(2, 3), "n": 4, "none": None}, gpu)
    assert moved["x"].device == gpu and moved["n"] == 4 and moved["none"] is None
    assert ops.log == [("new_stream", "cuda:0"), ("pin", (2, 3)),
                       ("copy", "cuda:0", True, "copy:cuda:0"), ("record", "e1", "copy:cuda:0")]
    ops.log.clear()
    copies.wait(arrival, gpu)  # the receiver's stream waits, and holds the copy's memory
    assert ops.log == [("wait_event", "current:cuda:0", "e1"),
                       ("record_stream", "cuda:0", "current:cuda:0")]


def test_gpu_to_gpu_copies_after_the_source_stream_and_keeps_the_source_alive():
    ops = FakeCudaOps()
    copies = DeviceCopies(ops)
    moved, arrival = copies.move({"h": on_gpu(0, 4), "nested": [on_gpu(0, 2)]},
                                 torch.device("cuda:1"))
    assert moved["h"].device == torch.device("cuda:1")
    assert moved["nested"][0].device == torch.device("cuda:1")
    assert ("pin", (4,)) not in ops.log
    assert ops.log[:4] == [("new_stream", "cuda:1"),
                           ("wait_stream", "copy:cuda:1", "current:cuda:0"),
                           ("copy", "cuda:1", True, "copy:cuda:1"),
                           ("record_stream", "cuda:0", "copy:cuda:1")]
    assert ops.log.count(("new_stream", "cuda:1")) == 1  # one copy stream per device
    assert [entry[0] for entry in ops.log].count("record") == 1  # one event per message
    assert len(arrival.events) == 1 and arrival.events[0][1] == "stream"


def test_gpu_to_host_makes_the_host_wait_for_the_event():
    ops = FakeCudaOps()
    copies = DeviceCopies(ops)
    moved, arrival = copies.move({"g": on_gpu(1, 3)}, torch.device("cpu"))
    assert moved["g"].device == torch.device("cpu")
    assert ("copy", "cpu", True, "copy:cuda:1") in ops.log  # the GPU end's copy stream
    ops.log.clear()
    copies.wait(arrival, torch.device("cpu"))
    assert ops.log == [("synchronize", "e1")]


def test_values_already_in_place_are_handed_over_without_cuda():
    ops = FakeCudaOps()
    x = torch.ones(2)
    moved, arrival = DeviceCopies(ops).move({"x": x}, torch.device("cpu"))
    assert moved["x"] is x and ops.log == [] and arrival.events == []
    moved, _ = DeviceCopies(ops).move({"x": torch.ones(2, device="meta")}, torch.device("cpu"))
    assert ops.log == [("copy", "cpu", False, "caller")]  # other devices: a plain .to()


def test_local_transport_delivers_a_host_tensor_to_a_gpu_stage():
    transport = LocalTransport(["cpu", "cuda:0"], timeout=5.0)
    ops = FakeCudaOps()
    transport.copies = DeviceCopies(ops)
    key = MicroBatchKey(0, 0)
    transport.send(0, 1, "F", key, {"h": torch.ones(2)})
    got = transport.recv(0, 1, "F", key)
    assert got["h"].device == torch.device("cuda:0")
    assert ("wait_event", "current:cuda:0", "e1") in ops.log


def test_a_gpu_worker_makes_its_device_current(monkeypatch):
    entered = []
    monkeypatch.setattr(torch.cuda, "device", lambda device: entered.append(device)
                        or contextlib.nullcontext())
    with device_context(torch.device("cuda:1")):
        pass
    with device_context(torch.device("cpu")):
        pass
    assert entered == [torch.device("cuda:1")]


class FakeCuda:
    """torch.cuda for the event clock: event k fires k ms after the first."""

    def __init__(self) -> None:
        self.made, self.waited = 0, []
        test = self

        class ClockEvent:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.number = test.made
                test.made += 1

            def record(self, stream) -> None:
                self.stream = stream

            def synchronize(self) -> None:
                test.waited.append(self.number)

            def elapsed_time(self, other) -> float:
                return float(other.number - self.number)

        self.Event = ClockEvent

    def current_stream(self, device):
        return f"stream of {device}"


def test_a_gpu_stage_is_timed_by_events_on_its_stream():
    cuda = FakeCuda()
    clock = action_clock(torch.device("cuda:0"), origin=0.0, cuda=cuda)
    assert isinstance(clock, CudaEventClock)
    began, ended = clock.mark(), clock.mark()
    assert began.stream == "stream of cuda:0"
    assert clock.seconds(ended) - clock.seconds(began) == pytest.approx(1e-3)
    assert cuda.waited == [2, 1]  # reading a mark waits for it
    assert isinstance(action_clock(torch.device("cpu"), 0.0), HostClock)


def test_inputs_targets_and_input_gradients_go_through_the_device_placement(
        monkeypatch):
    """The first stage's inputs, the last stage's target and the inputs' gradients pass through
    the device placement (all on the CPU here, where it hands values over)."""
    placed = []
    real = driver.to_device

    def recording(values, device, copies=None):
        placed.append((sorted(values), str(device)))
        return real(values, device, copies)

    monkeypatch.setattr(driver, "to_device", recording)
    monkeypatch.setattr(executor, "to_device", recording)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    pipe = fxpipe.compile(model, fxpipe.Plan(stages=2, micro_batches=2, devices=["cpu", "cpu"],
                                             loss_fn=F.mse_loss), example_inputs=(x,))
    pipe.step(x, y)
    assert placed.count((["target"], "cpu")) == 2  # once per micro-batch, on the last stage
    assert len([p for p in placed if p[0] != ["target"]]) == 2  # the inputs, on the first
    xg = x.clone().requires_grad_(True)
    pipe(xg).sum().backward()
    assert xg.grad is not None and xg.grad.device == xg.device


def test_an_nccl_coordinator_keeps_its_tensors_on_the_gpu(monkeypatch):
    monkeypatch.setattr(coordinator.dist, "get_backend", lambda group=None: "nccl")
    on_nccl = coordinator.DistCoordinator([0, 1], 2, "cuda:1")
    assert on_nccl.device == torch.device("cuda:1") and not on_nccl._point_to_point
    monkeypatch.setattr(coordinator.dist, "get_backend", lambda group=None: "gloo")
    assert coordinator.DistCoordinator([0, 1], 2, "cuda:1").device == torch.device("cpu")


def test_a_cpu_embedding_stage_feeds_a_stage_on_another_device():
    """Mixed placement with the meta device standing for the GPU: the embedding computes on
    the CPU, its output crosses to the next stage's device, which computes the rest."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x = torch.randint(0, 10, (4, 5))
    plan = fxpipe.Plan(stages=2, micro_batches=2, devices=["cpu", "meta"], costs="none",
                       partitioner=[1, 3])
    pipe = fxpipe.compile(model, plan, example_inputs=(x,))
    assert [p.device.type for p in pipe.parameters()] == ["cpu"] + ["meta"] * 4
    with torch.no_grad():
        out = pipe(x)
    assert out.device.type == "meta" and out.shape == (4, 5, 3)
