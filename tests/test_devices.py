"""Device decisions (fxpipe.devices) and the CUDA branches using them, without a GPU."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fxpipe
from fxpipe import devices
from fxpipe.compiler.inputs import stage_devices
from fxpipe.distributed import RankLayout, rank_device, rank_layout
from fxpipe.errors import PlanError
from fxpipe.passes.analysis import comm, profile, profile_cache
from fxpipe.preserve import preserved_state

DEVICES = ["cpu", "cuda:0", "cuda:1", "meta"]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(DEVICES), st.sampled_from(DEVICES))
def test_a_copy_is_asynchronous_exactly_when_a_gpu_is_an_end(src, dst):
    route = devices.copy_route(src, dst)
    if src == dst:
        assert route is None
        return
    kinds = {torch.device(src).type, torch.device(dst).type}
    gpu = "cuda" in kinds and kinds <= {"cpu", "cuda"}
    assert route.non_blocking == gpu and (route.stream == "copy") == gpu
    assert route.pin == (src == "cpu" and gpu)  # only a host source is staged in pinned memory
    # a copy to the host lands asynchronously in pinned memory: the host itself must wait
    expected = ("host" if dst == "cpu" else "stream") if gpu else "none"
    assert route.wait == expected


def test_only_host_tensors_bound_for_a_gpu_are_pinned():
    host = torch.ones(2)
    assert devices.should_pin(host, "cuda:0")
    assert not devices.should_pin(host, "cpu")
    assert not devices.should_pin(host, "meta")
    assert not devices.should_pin(3, "cuda:0")
    assert not devices.should_pin(torch.ones(2, device="meta"), "cuda:0")


@pytest.mark.parametrize("placed, recompute, locked", [
    (["cpu", "cpu"], [True, False], [True, True]),  # one CPU generator for both
    (["cpu", "cpu"], [False, False], [False, False]),  # nothing recomputes: no lock
    (["cuda:0", "cuda:1"], [True, True], [False, False]),  # a generator each
    (["cpu", "cuda:0"], [False, True], [True, True]),  # its recompute swaps the CPU's state
    (["cpu", "cuda:0"], [True, False], [True, False]),
])
def test_stages_wait_for_each_other_only_where_they_share_the_cpu_generator(placed, recompute,
                                                                             locked):
    assert devices.shares_cpu_generator(placed, recompute) == locked



@pytest.mark.parametrize("device, kind", [("cuda", "cuda-events"), ("cuda:3", "cuda-events"),
                                          ("cpu", "perf-counter"), ("meta", "perf-counter")])
def test_the_timer_follows_the_device(device, kind):
    assert devices.timer_kind(device) == kind
    assert devices.timer_kind(torch.device(device)) == kind


@pytest.mark.parametrize("placed, backend", [
    (["cuda:0", "cuda:1"], "cpu:gloo,cuda:nccl"), (["cpu", "cpu"], "gloo"),
    (["cpu", "cuda:0", "cuda:1"], "cpu:gloo,cuda:nccl"), (["meta"], "gloo")])
def test_the_backend_follows_the_devices(placed, backend):
    assert devices.backend_for(placed) == backend
    assert devices.job_backend(placed, cuda_count=8) == backend


def test_a_plan_without_devices_gets_nccl_on_a_gpu_node_and_gloo_elsewhere():
    assert devices.job_backend(None, cuda_count=2) == "cpu:gloo,cuda:nccl"
    assert devices.job_backend(None, cuda_count=0) == "gloo"


@pytest.mark.parametrize("own, peer, wire", [("cuda:1", "cuda", "cuda:1"), ("cuda:1", "cpu", "cpu"),
                                             ("cpu", "cuda", "cpu"), ("cpu", "cpu", "cpu")])
def test_messages_between_ranks_travel_from_a_gpu_only_when_both_have_one(own, peer, wire):
    assert devices.wire_device(own, peer) == torch.device(wire)


@pytest.mark.parametrize("given_, local_rank, count, expected", [
    (None, 3, 4, "cuda:3"), (None, 5, 4, "cuda:1"), (None, 2, 0, "cpu"),
    ("cuda", 2, 4, "cuda:2"), ("cuda:0", 2, 4, "cuda:0"), ("cpu", 1, 4, "cpu")])
def test_a_rank_runs_on_its_local_gpu_unless_the_plan_names_one(given_, local_rank, count,
                                                                  expected):
    assert devices.plan_rank_device(given_, local_rank, count) == torch.device(expected)


@pytest.mark.parametrize("given_, count, message", [
    ("cuda:2", 2, "has 2 CUDA devices"), ("cuda", 0, "has no CUDA device")])
def test_a_gpu_the_node_lacks_is_refused(given_, count, message):
    with pytest.raises(PlanError, match=message):
        devices.plan_rank_device(given_, 0, count, rank=1, stage=1)


def test_slot_device_types_come_from_the_plan_or_the_node():
    assert devices.slot_device_types(["cpu", "cuda:1"], 0, 2) == ["cpu", "cuda"]
    assert devices.slot_device_types(None, 2, 3) == ["cuda"] * 3
    assert devices.slot_device_types(None, 0, 2) == ["cpu"] * 2


@pytest.fixture
def four_gpus(monkeypatch):
    """torch.cuda as on a node with 4 GPUs (nothing runs on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_torchrun_rank_device_uses_local_rank(four_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    layout = RankLayout(rank=6, world=8, stages=8, groups=1)
    assert rank_device(fxpipe.Plan(stages=8), layout) == "cuda:2"
    plan = fxpipe.Plan(stages=8, devices=["cuda"] * 8)
    assert rank_device(plan, layout) == "cuda:2"
    plan = fxpipe.Plan(stages=8, devices=[f"cuda:{i % 4}" for i in range(8)])
    assert rank_device(plan, layout) == "cuda:2"


def test_torchrun_rank_device_without_gpus_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    layout = RankLayout(rank=1, world=2, stages=2, groups=1)
    assert rank_device(fxpipe.Plan(stages=2), layout) == "cpu"


@pytest.mark.parametrize("placed, backend", [
    (None, "cpu:gloo,cuda:nccl"), (["cuda:0", "cuda:1"], "cpu:gloo,cuda:nccl"),
    (["cpu", "cpu"], "gloo")])
def test_torchrun_plan_with_devices_starts_nccl_not_gloo(four_gpus, monkeypatch, placed,
                                                           backend):
    started = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, timeout: started.append(backend))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    layout = rank_layout(fxpipe.Plan(stages=2, devices=placed))
    assert started == [backend] and layout.rank == 1


def test_one_process_refuses_a_gpu_the_machine_lacks(four_gpus):
    model = torch.nn.Linear(2, 2)
    plan = fxpipe.Plan(stages=2, devices=["cuda:1", "cuda:7"])
    with pytest.raises(PlanError, match="'cuda:7', but this machine has 4 CUDA devices"):
        stage_devices(model, plan)
    assert stage_devices(model, fxpipe.Plan(stages=2, devices=["cpu", "cuda:3"])) == [
        "cpu", "cuda:3"]


class FakeEvent:
    """A torch.cuda.Event that says what was asked of it; 2.5 ms between any two."""

    log: ClassVar[list[str]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.log.append("event")

    def record(self, stream=None) -> None:
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def elapsed_time(self, other) -> float:
        return 2.5


def test_unit_profiling_on_a_gpu_times_with_events_and_waits_for_them(monkeypatch):
    FakeEvent.log = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = profile._timer(torch.device("cuda:0"))
    result, seconds = timer(lambda a: a + 1, 1)
    assert result == 2 and seconds == pytest.approx(2.5e-3)
    assert FakeEvent.log == ["event", "event", "record", "record", "synchronize"]
    _, host = profile._timer(torch.device("cpu"))(lambda: None)
    assert 0 <= host < 1


def test_link_timing_synchronises_gpus_only(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    comm._synchronize(torch.device("cpu"), torch.device("cuda:1"), torch.device("meta"))
    assert synced == [torch.device("cuda:1")]


@pytest.mark.parametrize("src, dst, kind", [("cuda:0", "cuda:1", "cuda-cuda"),
                                            ("cpu", "cuda:0", "cpu-cuda"),
                                            ("cuda:0", "cpu", "cpu-cuda")])
def test_default_links_know_gpu_pairs(src, dst, kind):
    for scope, distributed in (("local", False), ("distributed", True)):
        latency, bandwidth = comm._DEFAULTS[(scope, kind)]
        link = comm.default_link(src, dst, distributed)
        assert (link.latency, link.bandwidth) == (latency, bandwidth)


def test_the_profile_cache_key_names_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"Fake GPU on {device}")
    graph = torch.nn.Module()
    _, cuda = profile_cache.cache_key(graph, [], [2], "cuda:1", 1, 1, 0.0, (), None)
    _, cpu = profile_cache.cache_key(graph, [], [2], "cpu", 1, 1, 0.0, (), None)
    assert cuda["gpu"] == "Fake GPU on cuda:1" and cpu["gpu"] is None


class OnGpu(torch.Tensor):
    """A meta tensor that says it is on cuda:1: the device checks see a GPU tensor, and
    nothing touches its (absent) data."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda:1")


def on_gpu(*shape: int) -> torch.Tensor:
    return torch.Tensor._make_subclass(OnGpu, torch.empty(*shape, device="meta"))


def test_preserved_state_forks_the_rng_of_every_gpu_the_module_uses(monkeypatch):
    forked = []

    class Fork:
        def __init__(self, devices):
            forked.append(list(devices))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.random, "fork_rng", Fork)
    module = torch.nn.Linear(2, 2)
    module.weight = torch.nn.Parameter(on_gpu(2, 2))  # parameters only, no buffers
    with preserved_state(module):
        pass
    assert forked == [[torch.device("cuda:1")]]



def test_torchrun_ranks_know_every_stage_device_type_and_time_links_on_the_shared_wire(
        four_gpus, monkeypatch):
    from fxpipe.compiler import distributed as compiler_distributed

    layout = RankLayout(rank=1, world=3, stages=3, groups=1)
    plan = fxpipe.Plan(stages=3, devices=["cpu", "cuda:0", "cuda:1"])
    assert compiler_distributed.stage_device_types(plan, layout) == ["cpu", "cuda", "cuda"]
    assert compiler_distributed.stage_device_types(fxpipe.Plan(stages=3), layout) == [
        "cuda"] * 3
    timed = []
    monkeypatch.setattr(compiler_distributed, "measure_rank_link",
                        lambda a, b, group, device, reply_group=None: timed.append(device))
    monkeypatch.setattr(compiler_distributed.LinkGroups, "get", lambda self, src, dst: None)
    groups = compiler_distributed.LinkGroups(layout)
    compiler_distributed.ping_pong(plan, layout, groups, "cuda:0")  # stage 1, its peer the CPU
    on_gpus = fxpipe.Plan(stages=3, devices=["cuda:0", "cuda:1", "cuda:2"])
    compiler_distributed.ping_pong(on_gpus, layout, groups, "cuda:1")
    assert timed == ["cpu", "cuda:1"]


def test_the_cuda_calls_of_the_copies_are_torch_cudas(monkeypatch):
    from fxpipe.runtime.transport import CudaOps

    calls = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: calls.append(("Stream", device)))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device: calls.append(("current_stream", device)))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: calls.append(("stream", stream)))
    monkeypatch.setattr(torch.cuda, "Event", lambda: calls.append(("Event",)))

    class Recorded:
        def record_stream(self, stream):
            calls.append(("record_stream", stream))

    ops, gpu = CudaOps(), torch.device("cuda:0")
    ops.copy_stream(gpu), ops.current_stream(gpu), ops.use_stream("s"), ops.event()
    ops.record(Recorded(), "s")
    assert calls == [("Stream", gpu), ("current_stream", gpu), ("stream", "s"), ("Event",),
                     ("record_stream", "s")]
    assert ops.copy(torch.ones(2), torch.device("meta"), True).device.type == "meta"


def test_units_are_timed_on_the_first_gpu_of_the_stages():
    assert devices.timing_device(["cpu", "cuda:1", "cuda:0"]) == "cuda:1"
    assert devices.timing_device(["cpu", "cpu"]) == "cpu"
    assert devices.timing_device(["meta"]) == "meta"


def test_a_bare_cuda_device_is_named_by_its_index_so_stages_on_it_share_one_device(
        four_gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    model = torch.nn.Linear(2, 2)
    placed = stage_devices(model, fxpipe.Plan(stages=2, devices=["cuda", "cuda:2"]))
    assert placed == ["cuda:2", "cuda:2"]
    assert devices.copy_route(*placed) is None  # no copy between them


@pytest.mark.parametrize("backend, where", [("cpu:gloo,cuda:nccl", "cpu"), ("gloo", "cpu"),
                                            ("nccl", "cuda:1")])
def test_a_jobs_small_collectives_go_over_the_host_unless_it_has_nccl_alone(backend, where):
    assert devices.collective_device("cuda:1", backend) == torch.device(where)
