"""Opt-in: each stage's measured peak memory in a training step, beside the predicted one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from fxpipe.calibrate import check_flushed_training
from fxpipe.errors import FxpipeError
from fxpipe.preserve import gradients_set_aside, preserved_state
from fxpipe.report import MeasuredMemory

__all__ = ["measure_memory", "peak_rise"]


def measure_memory(pipe: Any, *inputs: Any, target: Any, optimizer: Any = None,
                   warmup: int = 1, **kwargs: Any) -> MeasuredMemory:
    """Run `warmup` untimed steps and one measured step of `pipe` on `inputs` and `target` (as
    pipe.step takes them) and measure each stage's peak (MeasuredMemory). `optimizer`: a
    torch optimizer (or a list of them) over the pipeline's parameters whose state is counted
    per stage as it is now (None: the pipeline's attached optimizers, else no state).

    A stage's activation peak is its device's: CUDA's allocator statistics per device; on the
    CPU, torch.profiler's memory events of the thread that runs the stage, which is the calling
    thread only when this process holds one stage (under torchrun, one stage per rank). On a
    GPU it resets the device's peak statistics (torch.cuda.reset_peak_memory_stats), as a
    measurement of a peak must; read your own before, if you keep them.
    Stages sharing a device (or a rank) each show that device's activation peak. The steps
    leave no gradient, buffer, random number generator or last run changed. Under
    torchrun every rank calls it, as pipe.step, and gets every stage's figures."""
    _check(pipe, warmup)
    runners = pipe.executor.runners
    devices = {runner.device for runner in runners.values()}
    # one process runs each device's stages on a worker thread of its own; a rank, inline
    if any(d.type != "cuda" for d in devices) and len(runners) > 1 and pipe.rank is None:
        raise FxpipeError(
            f"this process runs stages {sorted(runners)} on worker threads of one CPU, and the "
            "profiler sees only the calling thread's allocations, so a stage's peak cannot be "
            "told apart here: measure under torchrun, one stage per rank (torchrun "
            f"--nproc-per-node {pipe.plan.stages} your_script.py; `fxpipe bench --nproc "
            f"{pipe.plan.stages}`), or on CUDA devices.")
    executor = pipe.executor
    with preserved_state(pipe), gradients_set_aside(pipe), executor.runs_aside():
        for _ in range(warmup):
            pipe.step(*inputs, target, **kwargs)
        with peak_rise(sorted(devices, key=str)) as rise:
            pipe.step(*inputs, target, **kwargs)
        mine = {s: (*_state_bytes(pipe.stages[s].module, optimizer, pipe),
                    rise[runner.device]) for s, runner in runners.items()}
    every = _gathered(mine, pipe.rank is not None)
    how = ("CUDA allocator statistics per device" if all(d.type == "cuda" for d in devices)
           else "torch.profiler memory events, one stage per process")
    columns = zip(*(every[s] for s in range(pipe.plan.stages)))
    return MeasuredMemory(*(tuple(float(v) for v in column) for column in columns), how=how)


@contextlib.contextmanager
def peak_rise(devices: Sequence[torch.device]) -> Iterator[dict[torch.device, float]]:
    """Per device, the most bytes allocated meanwhile above what was allocated at the start
    (filled in when the block ends): CUDA's allocator statistics, or on the CPU the running
    sum of torch.profiler's memory events of this thread (whatever this thread allocates,
    for any of the CPU devices)."""
    result: dict[torch.device, float] = {}
    cuda = [d for d in devices if d.type == "cuda"]
    cpu = [d for d in devices if d.type != "cuda"]
    if cpu and torch.autograd.profiler._is_profiler_enabled:
        raise FxpipeError("a torch.profiler session is running in this thread, and measuring "
                          "memory on the CPU runs one of its own: measure outside it.")
    base = {}
    for device in cuda:
        torch.cuda.synchronize(device)
        base[device] = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) if cpu else \
            contextlib.nullcontext() as session:
        yield result
    for device in cuda:
        torch.cuda.synchronize(device)
        result[device] = float(torch.cuda.max_memory_allocated(device) - base[device])
    if cpu:
        events = session.profiler.kineto_results.events()
        changes = sorted((e.start_ns(), e.nbytes()) for e in events
                         if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
        level = np.cumsum([n for _, n in changes], dtype=np.float64)
        result.update(dict.fromkeys(cpu, max(float(level.max(initial=0.0)), 0.0)))


def _state_bytes(module: torch.nn.Module, optimizer: Any, pipe: Any) -> tuple[float, ...]:
    """A stage's parameters and buffers, their gradients, and the optimizer state of its
    parameters (a weight tied across stages counts in each, as each device holds it)."""
    params = list(module.parameters())
    weights = sum(t.nbytes for t in [*params, *module.buffers()])
    gradients = sum(p.grad.nbytes for p in params if p.grad is not None)
    optimizers = (list(optimizer) if isinstance(optimizer, (list, tuple)) else
                  [optimizer] if optimizer is not None else
                  [r.policy.optimizer for r in pipe.executor.runners.values()
                   if r.policy is not None and r.policy.optimizer is not None])
    state = 0
    for opt in optimizers:
        for param in params:
            for value in opt.state.get(param, {}).values():
                if isinstance(value, torch.Tensor):
                    state += value.nbytes
    return float(weights), float(gradients), float(state)


def _gathered(mine: dict[int, tuple[float, ...]], distributed: bool
              ) -> dict[int, tuple[float, ...]]:
    """Every stage's figures on every rank (the most over pipeline groups' copies of a
    stage); a pipeline in one process (even inside a job of several): this process's."""
    dist = torch.distributed
    if not distributed:
        return mine
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    every: dict[int, tuple[float, ...]] = {}
    for part in parts:
        for stage, values in part.items():
            held = every.get(stage, values)
            every[stage] = tuple(max(a, b) for a, b in zip(held, values))
    return every


def _check(pipe: Any, warmup: int) -> None:
    check_flushed_training(pipe, "measure_memory", "measures a flushed step",
                           "runs a training step, which needs")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise FxpipeError(f"measure_memory(warmup={warmup!r}) takes a whole number >= 0.")
