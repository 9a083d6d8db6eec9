"""The front half of compiling: the user's inputs checked, the model traced and cut into
units, and its units timed into a CostTable."""

from __future__ import annotations

import inspect
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.affinity import usable_cores
from fxpipe.batching import input_dims, resize
from fxpipe.cost import CostTable, Link, Partition, fit_to_flops
from fxpipe.errors import FxpipeError, FxpipeTraceError, PlanError
from fxpipe.ir import CommTable, ValueRef
from fxpipe.materialize import has_meta_tensors, on_meta
from fxpipe.meta import SHAPE, ValueInfo
from fxpipe.passes.analysis.capacity import ThreadCapacity, thread_capacity
from fxpipe.passes.analysis.comm import annotate_comm, default_link, measure_local_link
from fxpipe.passes.analysis.costs import cost_table
from fxpipe.passes.analysis.profile import (
    DEFAULT_LOAD,
    MIN_TIMED,
    ProfileCache,
    annotate_profile,
    default_cache_dir,
    profile_units,
    real_bytes,
    unit_parameters,
)
from fxpipe.passes.analysis.shape import annotate_shapes, record_values
from fxpipe.passes.analysis.symbolic import flops_of_units
from fxpipe.passes.rewrite.stages import split_stages
from fxpipe.plan import Plan
from fxpipe.probes import preserved_state
from fxpipe.runtime.transport import LocalTransport
from fxpipe.trace import trace
from fxpipe.units import Unit, cut_units

__all__ = [
    "busy_stages", "check_batched_inputs", "check_example_runs", "check_stage_count",
    "check_whole_inputs", "example_args", "measure_costs", "measure_thread_capacity",
    "output_names", "profile_cache", "split_into_units", "stage_devices", "stage_link",
    "threads_per_stage", "trace_and_cut", "units_of", "whole_positions",
]


def example_args(example_inputs: Any, example_kwargs: Mapping[str, Any] | None):
    if example_inputs is None and not example_kwargs:
        raise FxpipeError(
            "compile() needs one example batch to record shapes: "
            "fxpipe.compile(model, plan, example_inputs=(x,))."
        )
    if example_inputs is None:
        args: tuple = ()
    elif isinstance(example_inputs, tuple):
        args = example_inputs
    elif isinstance(example_inputs, list):
        args = tuple(example_inputs)
    else:
        args = (example_inputs,)
    return args, dict(example_kwargs or {})


def stage_devices(model: torch.nn.Module, plan: Plan) -> list[str]:
    """One device per stage: the plan's, or the device the model's parameters are on (the
    CPU for a model on the meta device)."""
    if plan.devices is None:
        first = next(iter(model.parameters()), None)
        device = str(first.device) if first is not None and not first.is_meta else "cpu"
        return [device] * plan.stages
    for name in plan.devices:
        device = torch.device(name)
        if device.type == "cuda":
            count = torch.cuda.device_count()
            index = device.index or 0
            if index >= count:
                raise PlanError(
                    f"Plan(devices=...) names {name!r}, but this machine has {count} CUDA "
                    f"device{'s' if count != 1 else ''}; use devices={['cpu'] * plan.stages} "
                    "to run every stage on the CPU."
                )
        elif device.type not in ("cpu", "meta") and not _backend_available(device.type):
            raise PlanError(f"Plan(devices=...) names {name!r}, but no {device.type} device "
                            "is available here.")
    return list(plan.devices)


def _backend_available(kind: str) -> bool:
    backend = getattr(torch, kind, None) or getattr(torch.backends, kind, None)
    return bool(backend is not None and getattr(backend, "is_available", lambda: False)())


def trace_and_cut(model, plan, args, kwargs):
    check_whole_inputs(model, plan)
    try:
        traced = trace(model, args, kwargs, plan, check=shapes_on(args, kwargs))
    except FxpipeTraceError:
        check_example_runs(model, args, kwargs)  # the likelier cause, if so
        raise
    units = cut_units(traced.gm, plan.unit_depth, traced.leaf_paths)
    check_stage_count(model, plan, units)
    return traced, units, traced.bind(args, kwargs)


def check_example_runs(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """The model runs on its example inputs (run without side effects)."""
    if has_meta_tensors(model):
        args, kwargs = on_meta((args, kwargs))
    try:
        with preserved_state(model), torch.no_grad():
            model(*args, **kwargs)
    except Exception as error:
        raise FxpipeError(
            f"the example inputs do not run through {type(model).__name__} itself "
            f"({type(error).__name__}: {error}); compile() traces the model on them, so give "
            "inputs that model(*example_inputs) accepts."
        ) from error


def check_whole_inputs(model: torch.nn.Module, plan: Plan) -> None:
    """Plan(whole_inputs=...) names arguments of the model's forward()."""
    names = list(inspect.signature(model.forward).parameters)
    unknown = [n for n in plan.whole_inputs if n not in names]
    if unknown:
        raise PlanError(
            f"Plan(whole_inputs={list(plan.whole_inputs)}) names {unknown}, which "
            f"{type(model).__name__}.forward() does not take; its arguments are {names}."
        )


def whole_positions(traced, plan: Plan, args: tuple, kwargs: Mapping[str, Any]
                    ) -> tuple[int, ...]:
    """Positions among the flat graph inputs of the arguments every micro-batch gets whole."""
    owners = traced.bind.argument_of_each_input(args, kwargs)
    return tuple(i for i, name in enumerate(owners) if name in plan.whole_inputs)


def check_batched_inputs(traced, plan: Plan, args: tuple, kwargs: Mapping[str, Any],
                         whole: Sequence[int]) -> None:
    """Inputs whose first dimension equals the batch size are split into micro-batches; one
    that only happens to (a (T, T) mask when T == B) must be named in Plan(whole_inputs=...).
    Run the graph on half the batch: the outputs must shrink in their first dimension only."""
    if plan.micro_batches == 1 and plan.groups == 1:
        return  # nothing is split
    flat = traced.bind(args, kwargs)
    owners, leaves, whole_leaves = [], [], []
    for i, (name, value) in enumerate(zip(traced.bind.argument_of_each_input(args, kwargs),
                                          flat)):
        for leaf in pytree.tree_leaves(value):  # fx graphs take nested arguments whole
            if i in whole:
                whole_leaves.append(len(leaves))
            owners.append(name)
            leaves.append(leaf)
    dims = input_dims(leaves, whole_leaves)
    if len(dims.batched) < 2 or dims.batch < 4:
        return  # one batched input is unambiguous; halves of 1 upset BatchNorm
    half = dims.batch // 2
    output = next(n for n in traced.gm.graph.nodes if n.op == "output")
    try:
        spec = pytree.tree_structure(list(flat))
        small = record_values(traced.gm, pytree.tree_unflatten(resize(leaves, dims, half), spec))
        consistent = all(_shrinks(n.meta[SHAPE], small[n.name], dims.batch, half)
                         for n in output.all_input_nodes)
        problem = "changes the outputs' shapes beyond their first dimension"
    except Exception as error:  # any failure is the symptom reported
        consistent, problem = False, f"fails ({type(error).__name__}: {error})"
    if consistent:
        return
    if has_meta_tensors(traced.gm) and not problem.startswith("changes"):
        raise FxpipeError(
            f"the model is on the meta device, and its graph cannot run on meta tensors to "
            f"check how it splits into micro-batches ({problem.removeprefix('fails ')}); "
            "build the model on a real device."
        )
    shared = sorted({owners[i] for i in dims.batched[1:]} - {owners[dims.batched[0]]})
    shapes = ", ".join(f"{owners[i]} {tuple(leaves[i].shape)}" for i in dims.batched)
    raise PlanError(
        f"splitting the example batch of {dims.batch} into micro-batches {problem}. fxpipe "
        f"splits every input whose first dimension is {dims.batch} ({shapes}); if one of them "
        f"is shared by all samples, name it: Plan(whole_inputs={shared or ['...']})."
    )


def _shrinks(full: ValueInfo, small: ValueInfo, batch: int, half: int) -> bool:
    return len(full.tensors) == len(small.tensors) and all(
        a.shape[0] != batch or (b.shape[0] == half and a.shape[1:] == b.shape[1:])
        for a, b in zip(full.tensors, small.tensors) if len(a.shape) > 0
    )


def shapes_on(args: tuple, kwargs: Mapping[str, Any]):
    """The check a candidate graph must pass: it runs on the example and gets its shapes."""
    return lambda traced: annotate_shapes(traced.gm, traced.bind(args, kwargs))


def check_stage_count(model: torch.nn.Module, plan: Plan, units: Sequence[Unit]) -> None:
    if plan.stages <= len(units):
        return
    names = ", ".join(u.name for u in units[:8]) + (", ..." if len(units) > 8 else "")
    finer = (" or cut finer with a larger Plan(unit_depth=...) or none"
             if plan.unit_depth is not None else "")
    raise PlanError(
        f"Plan(stages={plan.stages}) asks for more stages than {type(model).__name__} has "
        f"units: it cuts into {len(units)} units ({names}); use stages <= {len(units)}{finer}."
    )


def units_of(
    model: torch.nn.Module, example_inputs: Any, plan: Plan | None = None
) -> list[Unit]:
    """The units `compile` would cut `model` into (tracing options from `plan`, if given)."""
    plan = plan or Plan(stages=1)
    args, kwargs = example_args(example_inputs, None)
    traced = trace(model, args, kwargs, plan, check=shapes_on(args, kwargs))
    return cut_units(traced.gm, plan.unit_depth, traced.leaf_paths)


# A meta model's weights up to this many bytes are made real all at once to time its units,
# whatever share of them a device holds: each run of units timed apart has its first forward
# and first backward meet the caches a backward leaves, which costs them microseconds. That
# matters only where the units are that short, as small models' are: `python
# benchmarks/meta_timing.py --model mlp --shares 1,0.5` timed the bundled MLP's units in 3
# runs at 1.32x (forward) and 1.07x (backward) the real model's, and in one run at 1.01x.
ALL_REAL_BELOW = 256 * 2**20


def split_into_units(gm: torch.fx.GraphModule, units: Sequence[Unit], device: str
                     ) -> tuple[torch.fx.GraphModule, CommTable]:
    """The model split with one unit per stage, every one on `device`: the PipelineGraph and
    CommTable the units are timed and run through (profile_units, thread_capacity)."""
    return split_stages(gm, units, range(1, len(units) + 1), [device] * len(units))


def measure_costs(gm, units, flat, plan: Plan, devices, link: Link,
                  cache: ProfileCache | None, threads: int, concurrency: int = 1,
                  whole: Sequence[int] = (), warmup: int = 2, repeats: int = 5,
                  loss: Any = None, min_time: float = MIN_TIMED,
                  load: str = DEFAULT_LOAD, held: float = 1.0,
                  stages: Sequence[range] = ()) -> CostTable:
    """The CostTable: measured per unit at the plan's micro-batch size(s), or structure only;
    `concurrency` stages busy at once while timing, running `load`, `warmup` and `repeats`
    runs of each unit (more until they took `min_time` seconds), `loss(outputs, size)` timed
    too when given (see profile_units); a meta model's units with at most the share `held`
    of its weights real at once, what the timing device holds of them in the pipeline (all
    of them below ALL_REAL_BELOW bytes); `stages`: runs of units each timed as a run of its
    own (profile_units)."""
    unit_graph, unit_table = split_into_units(gm, units, devices[0])
    names = [u.name for u in units]
    if plan.costs == "none":
        params, param_bytes = unit_parameters(unit_graph, len(units))
        zeros = [0.0] * len(units)
        return CostTable(zeros, zeros, zeros, zeros, [1.0], None, params, tuple(names),
                         param_bytes)
    batch = input_dims(flat, whole).batch
    if isinstance(plan.micro_batches, int) and plan.micro_batches > batch:
        raise PlanError(
            f"Plan(micro_batches={plan.micro_batches}) splits the example batch of {batch} "
            f"samples into more micro-batches than samples; the units are timed on its "
            f"micro-batches, so give a full mini-batch as the example, or micro_batches <= "
            f"{batch}."
        )
    profile = profile_units(unit_graph, unit_table, flat, profile_sizes(batch, plan),
                            devices[0], warmup=warmup, repeats=repeats, cache=cache,
                            threads=threads, concurrency=concurrency, whole=whole, loss=loss,
                            load=load, min_time=min_time,
                            window=max(held * real_bytes(unit_graph), ALL_REAL_BELOW),
                            stages=stages)
    annotate_profile(gm, units, profile)
    annotate_comm(gm, link)
    cost = cost_table(profile, link, batch, names)
    if plan.costs == "fit":  # time as α·FLOPs(m) + β per unit, from the symbolic pass
        cost = fit_to_flops(cost, flops_of_units(gm, units, flat, whole),
                            loss=(profile.loss_forward, profile.loss_backward))
    return cost


def measure_thread_capacity(gm: torch.fx.GraphModule, units: Sequence[Unit],
                            flat: Sequence[Any], partition: Partition, devices: Sequence[str],
                            threads: int, whole: Sequence[int] = ()
                            ) -> ThreadCapacity | None:
    """Where two or more stage threads compute on this process's CPU, every stage on it: how
    much of the units' work as many threads as the stages, and as the cores (as the stages,
    where they are fewer), get through at once against one thread (`thread_capacity`, at the
    partition's micro-batch size); else None. It takes 0.73 to 0.81 s for the bundled MLP, GPT
    and VGG with 4 stage threads on 2 cores (`benchmarks/compile_time.py`), and about 16 times
    a run of all the units alone where a run takes over 0.05 s. A model built on the meta
    device is measured once its stages are real (compile makes them real first); one still on
    it is not measured. Within the cores too, as many threads can get through less than one
    thread's work: 2 of the bundled MLP's got through 0.62 to 0.86x on 2 cores (ACCURACY.md),
    and its stages then step faster on one thread (`share_stage_threads`)."""
    stages, cores = busy_stages(devices), usable_cores()
    on_cpu = all(torch.device(d).type == "cpu" for d in devices)
    if stages < 2 or not on_cpu or has_meta_tensors(gm):
        return None
    unit_graph, unit_table = split_into_units(gm, units, devices[0])
    size = -(-input_dims(flat, whole).batch // partition.micro_batches)
    most = min(cores, stages)  # more threads than the stages never run them
    capacity = thread_capacity(unit_graph, unit_table, flat, size, (most, stages),
                               threads=threads, whole=whole)
    return ThreadCapacity(cores, stages, capacity[most], capacity[stages])


def profile_sizes(batch: int, plan: Plan) -> list[int]:
    """Micro-batch sizes to time: the plan's; powers of two up to the batch when the
    micro-batch count is to be chosen ('auto', or the csimd partitioner), since time is not
    proportional to micro-batch size and the planner must see it at every size it considers."""
    if plan.micro_batches == "auto" or plan.partitioner == "csimd":
        return sorted({batch} | {2 ** k for k in range(batch.bit_length()) if 2 ** k <= batch})
    largest = -(-batch // plan.micro_batches)  # the largest micro-batch, ceil(B / p)
    if plan.costs == "fit":  # a line needs two points
        return sorted({largest, max(1, largest // 2)} if largest > 1 else {1, min(2, batch)})
    return [largest]


def stage_link(plan: Plan, devices: Sequence[str]) -> Link:
    """The link between stages: the plan's figures, measured, or the default for the devices.
    Stage threads on one CPU hand values over by reference, with no copy, but the hand-over
    still costs the sender its send and the receiver the wake-up: measured through the local
    transport, by default as with Plan(link="measure")."""
    if isinstance(plan.link, tuple):
        return Link(plan.link[0], plan.link[1], "plan")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not distributed and len(devices) > 1 and all(torch.device(d).type == "cpu"
                                                    for d in devices):
        latency, post = LocalTransport(["cpu", "cpu"]).measure_handoff()
        return Link(latency, math.inf, "measured: handed over between stage threads", post)
    if plan.link == "measure":
        return measure_local_link(devices[0], devices[-1])
    return default_link(devices[0], devices[-1], distributed)


def profile_cache(cache: bool | str | os.PathLike) -> ProfileCache | None:
    if cache is False:
        return None
    return ProfileCache(default_cache_dir() if cache is True else pathlib.Path(cache))


def busy_stages(devices: Sequence[str]) -> int:
    """How many stage threads compute on this process's CPU (GPU stages each have their own
    device), at least 1: the units are timed beside as many (profile_units' `concurrency`)."""
    return max(1, sum(torch.device(d).type == "cpu" for d in devices))


def threads_per_stage(devices: Sequence[str]) -> int:
    """Intra-op threads for each stage's worker: stages on the CPU share its threads evenly
    (more would oversubscribe the cores and slow every stage down)."""
    on_cpu = sum(torch.device(d).type == "cpu" for d in devices)
    return max(1, torch.get_num_threads() // max(on_cpu, 1))


def output_names(gm: torch.fx.GraphModule) -> Any:
    """The model's output structure with a ValueRef for each value a stage makes (constants
    stay as they are); refuses an output no stage makes."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in output.all_input_nodes:
        if node.op == "get_attr":
            raise FxpipeError(
                f"the model returns its attribute {node.target!r} as it is; fxpipe runs only "
                "computed outputs through the pipeline: return a tensor computed from it."
            )
    return torch.fx.map_arg(output.args[0], lambda n: ValueRef(n.name))
