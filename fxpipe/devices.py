"""Device decisions as pure functions: where a value goes, how it is copied, backend, timer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from fxpipe.errors import PlanError

__all__ = ["CopyRoute", "backend_for", "collective_device", "copy_route", "cuda_count",
           "job_backend", "plan_rank_device", "shares_cpu_generator", "should_pin",
           "slot_device_types", "timer_kind", "timing_device", "wire_device"]

Device = torch.device | str


@dataclasses.dataclass(frozen=True)
class CopyRoute:
    """How a tensor crosses from one device to another.

    `stream`: "copy" (the destination's copy stream, after the source's current stream, so
    the copy overlaps compute) or "current" (the calling thread's, blocking); `pin`: stage a
    host tensor in page-locked memory first (a pageable host buffer makes the copy synchronous);
    `wait`: how the receiver waits for the copy before it uses the value: "stream" (its CUDA
    stream waits on the copy's event), "host" (its thread waits on the event: a device-to-host
    copy lands in pinned memory asynchronously) or "none" (the copy is done when it returns).
    """

    stream: str
    pin: bool
    non_blocking: bool
    wait: str


_BLOCKING = CopyRoute(stream="current", pin=False, non_blocking=False, wait="none")


def _device(device: Device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def copy_route(src: Device, dst: Device) -> CopyRoute | None:
    """The route from `src` to `dst`, or None when the value is already where it goes. Only a
    copy touching a CUDA device is asynchronous; the meta device and other kinds (mps, xpu)
    copy as `.to()` does."""
    src, dst = _device(src), _device(dst)
    if src == dst:
        return None
    if dst.type == "cuda" and src.type == "cuda":  # peer copy (NVLink / PCIe)
        return CopyRoute(stream="copy", pin=False, non_blocking=True, wait="stream")
    if dst.type == "cuda" and src.type == "cpu":  # host to device: pinned, asynchronous
        return CopyRoute(stream="copy", pin=True, non_blocking=True, wait="stream")
    if dst.type == "cpu" and src.type == "cuda":  # lands in pinned memory; the host waits
        return CopyRoute(stream="copy", pin=False, non_blocking=True, wait="host")
    return _BLOCKING


def should_pin(value: Any, dst: Device) -> bool:
    """Whether `value` is a host tensor to stage in pinned memory before copying it to `dst`
    (not when it is pinned already)."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        return False
    route = copy_route(value.device, dst)
    return route is not None and route.pin and not value.is_pinned()


def collective_device(home: Device, backend: str) -> torch.device:
    """Where a small collective of a job (e.g. the loss scaler's inf/nan flag) is reduced:
    on the host wherever the job has gloo, since a job of CPU and GPU ranks reduces CPU
    tensors over gloo and GPU ones over NCCL and every rank must use the same kind; on
    `home` (this rank's GPU) in a job of NCCL alone."""
    return _device(home) if backend == "nccl" else torch.device("cpu")


def cuda_count() -> int:
    """The GPUs this process can use: none where CUDA is not available."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def timing_device(devices: Sequence[Device]) -> str:
    """The device compile times the units on: the first GPU of the stages' devices (with a
    CPU embedding stage before GPU stages, most stages run on GPUs), else the first device."""
    return str(next((d for d in devices if _device(d).type == "cuda"), devices[0]))


def timer_kind(device: Device) -> str:
    """How to time work on `device`: "cuda-events" (events on its stream: the kernels' time,
    not their launch) or "perf-counter" (the host clock, for work the host runs)."""
    return "cuda-events" if _device(device).type == "cuda" else "perf-counter"


def backend_for(devices: Sequence[Device]) -> str:
    """The torch.distributed backend of a job whose ranks run on `devices`: gloo when none is
    a GPU; else NCCL for tensors on GPUs and gloo for tensors on the host
    ("cpu:gloo,cuda:nccl"). Gloo then also carries the object collectives and barriers
    (compile's plan check, the traces, the state dict), which on NCCL alone would run on each
    rank's *current* CUDA device (cuda:0 on every rank unless the script called
    torch.cuda.set_device), and the small messages between a CPU rank and a GPU rank."""
    if any(_device(d).type == "cuda" for d in devices):
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def wire_device(own: Device, peer: Device) -> torch.device:
    """The device a message between two ranks travels from: the ranks' GPUs when both have
    one (NCCL), else the host (gloo), where a GPU rank stages it."""
    own, peer = _device(own), _device(peer)
    return own if own.type == "cuda" and peer.type == "cuda" else torch.device("cpu")


def plan_rank_device(given: str | None, local_rank: int, cuda_count: int, rank: int = 0,
                     stage: int = 0) -> torch.device:
    """The device a torchrun rank runs on: `given` (the plan's device of this rank; a bare
    "cuda" is the GPU numbered LOCAL_RANK on this node), else GPU LOCAL_RANK when the node has
    GPUs, else the CPU. Raises PlanError for a GPU the node does not have."""
    if given is None:
        device = torch.device("cuda", local_rank % cuda_count) if cuda_count else \
            torch.device("cpu")
    else:
        device = torch.device(given)
        if device.type == "cuda" and device.index is None:
            if not cuda_count:
                raise PlanError(f"rank {rank} (stage {stage}) is to run on {given!r}, but this "
                                "node has no CUDA device; use devices=None or 'cpu'.")
            device = torch.device("cuda", local_rank % cuda_count)
    if device.type == "cuda" and (device.index or 0) >= cuda_count:
        raise PlanError(
            f"rank {rank} (stage {stage}) is to run on {device}, but this node has "
            f"{cuda_count} CUDA devices; give every rank a device, e.g. launch fewer processes "
            "per node or pass Plan(devices=None).")
    return device


def slot_device_types(given: Sequence[str] | None, cuda_count: int, slots: int) -> list[str]:
    """The device type of each of a plan's `slots` device slots (ranks of one pipeline), as
    every rank can tell without asking: the plan's devices, or all "cuda" (each rank takes its
    node's GPU) or all "cpu" for devices=None."""
    if given is None:
        return ["cuda" if cuda_count else "cpu"] * slots
    return [_device(d).type for d in given]


def job_backend(given: Sequence[str] | None, cuda_count: int) -> str:
    """The backend fxpipe starts a torchrun job with: from the plan's devices, or as for GPUs
    when devices=None and the node has GPUs (backend_for)."""
    if given is None:
        return backend_for(["cuda"] if cuda_count else ["cpu"])
    return backend_for(given)


def shares_cpu_generator(devices: Sequence[Device], recompute: Sequence[bool]) -> list[bool]:
    """Per stage of one process, whether it takes the lock that keeps its random draws its own
    while a stage recomputes (`fxpipe.runtime.recompute`): every CPU stage, since they draw
    from the one CPU generator; and a recomputing GPU stage when there is a CPU stage, since
    checkpoint swaps the CPU generator's state for its recompute. GPU stages draw from their
    device's generator: with no CPU stage, none waits for another."""
    if not any(recompute):
        return [False] * len(devices)
    cpu = [_device(d).type == "cpu" for d in devices]
    return [on_cpu or (again and any(cpu)) for on_cpu, again in zip(cpu, recompute)]

