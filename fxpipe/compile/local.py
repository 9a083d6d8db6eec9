"""compile(): trace -> shapes -> units -> costs -> partition -> rewrite -> runtime; the one
place (with its sibling modules) where the IR, the passes and the runtime meet."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fxpipe.affinity import stage_cores, usable_cpus
from fxpipe.allocator import keep_for
from fxpipe.compile.distributed import compile_distributed
from fxpipe.compile.front import (
    busy_stages,
    check_batched_inputs,
    example_args,
    measure_costs,
    measure_thread_capacity,
    output_names,
    profile_cache,
    stage_devices,
    stage_link,
    threads_per_stage,
    trace_and_cut,
    whole_positions,
)
from fxpipe.compile.intra_layer import outline_split_stages, split_heavy_layers
from fxpipe.compile.loss import check_target, traced_loss
from fxpipe.compile.partitioning import choose_partition
from fxpipe.compile.retime import Timing, retime
from fxpipe.distributed import launched
from fxpipe.errors import FxpipeError, PlanError
from fxpipe.materialize import check_meta_model, has_meta_tensors
from fxpipe.passes.rewrite.stages import split_stages
from fxpipe.pipeline import CompiledPipeline
from fxpipe.plan import Plan
from fxpipe.runtime.executor import PipelineExecutor

__all__ = ["compile"]


def compile(
    model: torch.nn.Module,
    plan: Plan,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    example_target: Any = None,
    cache: bool | str | os.PathLike = True,
) -> CompiledPipeline:
    """Compile `model` into the pipeline `plan` describes.

    `example_inputs` is one example mini-batch (a tensor or a tuple of forward()'s positional
    arguments); it fixes the shapes, and the units are timed on slices of it. The model's
    parameters stay the same objects: the compiled module and the model train the same weights.
    `example_target` (a tensor, or a tuple, list or dict of them, with one row per sample of
    the inputs, as pipe.step takes the target): the plan's loss_fn is timed too, on
    the model's output, and counts in the last unit's costs, so the partition sees what the
    last stage computes in a step (without it the loss is left out); every unit is then timed
    afresh, as the disk cache holds no loss. `cache` keeps unit timings on disk (True:
    ~/.cache/fxpipe/profiles; a path; False: off).
    Where two or more stage threads compute on this process's CPU (every stage on the CPU, and
    the costs measured), it also measures how much of the units' work that many threads, and as
    many as the cores, get through at once against one, in under a second for a small model
    (`pipe.thread_capacity`): with Plan(stage_threads="auto"), the stages run on one thread
    where that many got through less than one thread's work (`share_stage_threads`), and
    `pipe.report()` prints it.

    A model built on the meta device (`with torch.device("meta"): model = Net()`) has each
    stage made real only on its own device (under torchrun: only this rank's stage), its
    values from the modules' reset_parameters(); load the weights with
    `pipe.load_state_dict(state_dict)`. Its units are timed on real copies, a run of
    consecutive units at a time holding no more weights than the device will (all of them
    below ALL_REAL_BELOW bytes), one such copy in each thread timing them (one per stage
    busy at once, at most one per core).
    Its stage tensors are new objects, put in the model's place under every name (a weight
    tied across modules gets the reset of the module that comes last); build optimizers
    after compile.
    """
    if not isinstance(model, torch.nn.Module):
        raise FxpipeError(f"compile() takes an nn.Module, got {type(model).__name__}.")
    if not isinstance(plan, Plan):
        raise FxpipeError(f"compile() takes an fxpipe.Plan, got {type(plan).__name__}; "
                          "e.g. fxpipe.Plan(stages=2).")
    args, kwargs = example_args(example_inputs, example_kwargs)
    if example_target is not None:
        check_target(plan, example_target)
    if has_meta_tensors(model):
        check_meta_model(model, plan)
    if launched():
        return compile_distributed(model, plan, args, kwargs, profile_cache(cache),
                                   example_target)
    if plan.groups > 1:
        raise PlanError(
            f"Plan(groups={plan.groups}) replicates the pipeline over ranks of a torchrun job; "
            f"launch with torchrun --nproc-per-node {plan.stages * plan.groups}, or use "
            "groups=1 in one process."
        )
    devices = stage_devices(model, plan)
    check_stage_threads(plan, devices)
    keep_for(plan.cpu_memory, devices)  # before anything is timed, as steps will run

    traced, units, flat = trace_and_cut(model, plan, args, kwargs)
    whole = whole_positions(traced, plan, args, kwargs)
    check_batched_inputs(traced, plan, args, kwargs, whole)
    link = stage_link(plan, devices)
    threads = threads_per_stage(devices)
    busy = busy_stages(devices)
    if isinstance(plan.stage_threads, int):  # that many threads compute at once at most
        busy = min(busy, plan.stage_threads)
    timing = Timing(devices[0], threads, busy,
                    held=devices.count(devices[0]) / len(devices))  # its stages' weights
    cost = measure_costs(traced.gm, units, flat, plan, [timing.device], link,
                         profile_cache(cache), timing.threads, timing.concurrency, whole,
                         loss=traced_loss(traced, plan, example_target, flat, whole,
                                          timing.device),
                         load=timing.load, held=timing.held)
    partition = choose_partition(model, plan, units, cost)
    gm, splits = traced.gm, []
    if plan.intra_layer is not None:
        gm, splits = split_heavy_layers(gm, units, partition, cost, plan.intra_layer, devices,
                                        flat, link)
    graph, comm = split_stages(gm, units, partition.bounds, devices)
    pipe = CompiledPipeline(model, plan, traced, units, partition, graph, comm, devices,
                            cost, link)
    pipe.intra_layer, pipe.timing = splits, timing
    pipe.link_probe = lambda _flat: stage_link(plan, devices)
    for name, stages in pipe.shared_parameters().items():
        places = sorted({torch.device(devices[s]) for s in stages}, key=str)
        if len(places) > 1:
            raise FxpipeError(
                f"weight {name!r} is used by stages {stages}, which are on "
                f"{', '.join(map(str, places))}; one Parameter cannot live on several devices "
                "in one process: put those stages on one device, or run one stage per rank "
                "under torchrun (tied weights' copies then get summed gradients)."
            )
    hooks = [pipe.stage_hook(s) for s in range(plan.stages)]
    outline_split_stages(pipe.stages, hooks, splits)
    for index, (stage, device) in enumerate(zip(pipe.stages, devices)):
        pipe.materialize_stage(index, device, model)  # a meta model's, where each will run
        stage.to(device)
    pipe.executor = PipelineExecutor.local(
        pipe.stages, hooks, comm, devices, output_names(gm), plan.schedule,
        partition.micro_batches, traced.bind.unflatten, threads=threads,
    )
    pipe.executor.whole = whole
    if plan.costs != "none":
        # how much work the stage threads get through at once: one thread for all where less
        # than one thread's, and for the report
        pipe.thread_capacity = measure_thread_capacity(traced.gm, units, flat, partition,
                                                       devices, threads, whole)
        bind_stage_threads(pipe)
    share_stage_threads(pipe, args, kwargs, example_target)
    if plan.costs != "none":
        # the runtime's own time, for predicting whole steps, where the steps will run
        pipe.measure_runtime_overhead(*args, **kwargs)
    return pipe


def check_stage_threads(plan: Plan, devices: list[str]) -> None:
    """Stages that Plan(stage_threads=n) puts on one thread must be on one device."""
    if not isinstance(plan.stage_threads, int):
        return
    for group in deal_stages(range(plan.stages), plan.stage_threads):
        places = sorted({devices[s] for s in group})
        if len(places) > 1:
            raise PlanError(
                f"Plan(stage_threads={plan.stage_threads}) runs stages {sorted(group)} on one "
                f"thread, but they are on {', '.join(places)}; one thread runs its stages on "
                "one device: give devices so that stages s and s + stage_threads match, or "
                "stage_threads='stage'."
            )


def deal_stages(stages: Iterable[int], threads: int) -> list[tuple[int, ...]]:
    """The stages dealt round `threads` threads (stage s on thread s mod threads), each
    thread's listed last first: of its stages whose next action need not wait, a thread runs
    the one nearest the loss, which finishes micro-batches and frees their memory soonest."""
    stages = sorted(stages)
    return [tuple(reversed(stages[t::threads])) for t in range(min(threads, len(stages)))]


def share_stage_threads(pipe: CompiledPipeline, args: Any, kwargs: Any, target: Any) -> None:
    """Run the stages on fewer threads than stages where the plan says so, or, with
    Plan(stage_threads="auto"), on one thread where as many threads as the stages on the CPU
    got through less than one thread's work at once (`thread_capacity`, measured where two or
    more are): Python's interpreter lock then sets their pace, and one thread, which leaves
    the cores no more idle than the lock does, steps faster. The bundled MLP's 4 stages on 2
    cores did, every row of `fxpipe bench` within 15% of its prediction, and so did its 2
    stages (ACCURACY.md). The units are then timed again beside as many busy threads, as the
    steps will run them (`retime`)."""
    plan, executor = pipe.plan, pipe.executor
    stages = sorted(executor.runners)
    if isinstance(plan.stage_threads, int):
        threads = plan.stage_threads
    elif plan.stage_threads == "auto" and pipe.thread_capacity is not None \
            and not pipe.thread_capacity.shares_mostly_cores:
        threads = 1
    else:
        return
    if threads >= len(stages):
        return
    executor.driver.share(deal_stages(stages, threads))
    if isinstance(plan.stage_threads, str):  # compile timed the units beside more threads
        pipe.timing = dataclasses.replace(pipe.timing, concurrency=threads)
        pipe.partition = retime(pipe, args, kwargs, target=target)


def bind_stage_threads(pipe: CompiledPipeline) -> None:
    """With Plan(cpu_affinity="auto"), where stage threads of one intra-op thread each
    outnumber the cores (2 or more) and what they share is mostly the cores
    (`thread_capacity`, measured only then: not with Plan(costs="none")), bind each to a core
    (`stage_cores`), as the prediction then has them: each core shared by the stages on it.
    Left unbound, a stage woken by a message may wait for a busy core while another idles,
    which the prediction leaves out; bound, the bundled VGG, ResNet and HF models stepped
    about as fast and were predicted closer (benchmarks/thread_placement.py, ACCURACY.md).
    Where more threads got much less done (the interpreter lock: the bundled MLP), the cores
    are no model of what limits them, and they stay unbound."""
    capacity, driver = pipe.thread_capacity, pipe.executor.driver
    if (pipe.plan.cpu_affinity != "auto" or capacity is None or not capacity.past_the_cores
            or not capacity.shares_mostly_cores or (driver.threads or 1) > 1):
        return
    cpus = usable_cpus()
    if len(cpus) > 1:  # the driver binds nothing where threads cannot be bound (not Linux)
        driver.bind(stage_cores(sorted(pipe.executor.runners), cpus))
