"""compile(): trace -> shapes -> units -> partition -> rewrite, the one place passes meet the IR."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fxpipe.batching import input_dims
from fxpipe.cost import CostTable, Link, Partition
from fxpipe.distributed import launched, rank_device, rank_layout
from fxpipe.errors import FxpipeError, PlanError
from fxpipe.passes.analysis.comm import default_link
from fxpipe.passes.analysis.costs import cost_table
from fxpipe.passes.analysis.profile import (
    ProfileCache,
    default_cache_dir,
    profile_units,
    unit_parameters,
)
from fxpipe.passes.analysis.shape import annotate_shapes
from fxpipe.passes.analysis.symbolic import annotate_symbolic
from fxpipe.passes.partition import ampa, balanced, csimd, even, exact, imd, params
from fxpipe.passes.rewrite.stages import split_stages
from fxpipe.pipeline import CompiledPipeline
from fxpipe.plan import TIMED_PARTITIONERS, Plan
from fxpipe.report import step_time
from fxpipe.runtime.dist import DistCoordinator, DistTransport
from fxpipe.runtime.executor import PipelineExecutor
from fxpipe.runtime.hooks import GradientSync
from fxpipe.runtime.stage import StageRunner
from fxpipe.trace import trace
from fxpipe.units import Unit, cut_units

__all__ = [
    "Replan", "available_partitioners", "compare_partitioners", "compile", "replan", "units_of",
]

_PARTITIONERS = {
    "even": even, "params": params, "balanced": balanced, "ampa": ampa, "imd": imd,
    "csimd": lambda cost, stages, p=1: csimd(cost, stages, cost.batch, p0=p), "exact": exact,
}


def compile(
    model: torch.nn.Module,
    plan: Plan,
    example_inputs: Any = None,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    cache: bool | str | os.PathLike = True,
) -> CompiledPipeline:
    """Compile `model` into the pipeline `plan` describes.

    `example_inputs` is one example mini-batch (a tensor or a tuple of forward()'s positional
    arguments); it fixes the shapes, and the units are timed on slices of it. The model's
    parameters stay the same objects: the compiled module and the model train the same weights.
    `cache` keeps unit timings on disk (True: ~/.cache/fxpipe/profiles; a path; False: off).
    """
    if not isinstance(model, torch.nn.Module):
        raise FxpipeError(f"compile() takes an nn.Module, got {type(model).__name__}.")
    if not isinstance(plan, Plan):
        raise FxpipeError(f"compile() takes an fxpipe.Plan, got {type(plan).__name__}; "
                          "e.g. fxpipe.Plan(stages=2).")
    args, kwargs = _example(example_inputs, example_kwargs)
    if launched():
        return _compile_distributed(model, plan, args, kwargs, _profile_cache(cache))
    devices = _devices(model, plan)

    traced, units, flat = _trace_and_cut(model, plan, args, kwargs)
    link = _link(plan, devices)
    threads = _threads_per_stage(devices)
    cost = _costs(traced.gm, units, flat, plan, devices, link, _profile_cache(cache), threads)
    partition = _partition(model, plan, units, cost)
    graph, comm = split_stages(traced.gm, units, partition.bounds, devices)
    pipe = CompiledPipeline(model, plan, traced, units, partition, graph, comm, devices,
                            cost, link)
    for stage, device in zip(pipe.stages, devices):
        stage.to(device)
    pipe.executor = PipelineExecutor.local(
        pipe.stages, [pipe.stage_hook(s) for s in range(plan.stages)], comm, devices,
        _output_names(traced.gm), plan.schedule, partition.micro_batches, traced.bind.unflatten,
        threads=threads,
    )
    return pipe


def _trace_and_cut(model, plan, args, kwargs):
    traced = trace(model, args, kwargs, plan, check=_shapes_on(args, kwargs))
    units = cut_units(traced.gm, plan.unit_depth, traced.leaf_paths)
    _check_stage_count(model, plan, units)
    return traced, units, traced.bind(args, kwargs)


def _compile_distributed(model, plan: Plan, args, kwargs, cache) -> CompiledPipeline:
    """Under torchrun: every rank traces the same graph; rank 0 measures the costs and chooses
    the partition and every rank takes them from it; each rank then keeps only its stage on its
    device, and talks to the others over torch.distributed."""
    layout = rank_layout(plan)
    device = rank_device(plan, layout)
    traced, units, flat = _trace_and_cut(model, plan, args, kwargs)
    _agree(layout, plan, units)
    link = _link(plan, [device, device])
    threads = torch.get_num_threads()
    if layout.rank == 0:
        cost = _costs(traced.gm, units, flat, plan, [device], link, cache, threads)
        chosen = _partition(model, plan, units, cost)
        shared: list[Any] = [cost, chosen.bounds, chosen.micro_batches, chosen.partitioner]
    else:
        shared = [None] * 4
    torch.distributed.broadcast_object_list(shared, src=0)
    cost, bounds, micro_batches, name = shared
    partition = Partition.evaluate(cost, bounds, micro_batches, name, schedule=plan.schedule)
    annotate_symbolic(traced.gm, flat)  # message shapes as functions of the micro-batch size
    devices = [device] * plan.stages
    graph, comm = split_stages(traced.gm, units, partition.bounds, devices)
    pipe = CompiledPipeline(model, plan, traced, units, partition, graph, comm, devices,
                            cost, link)
    stage = pipe.stages[layout.stage]
    stage.to(device)
    pipe.state_dict_keys = list(model.state_dict())
    pipe.restrict_to_stage(layout.stage, layout.rank)
    pipeline = _pipeline_group(layout)
    hook = pipe.stage_hook(layout.stage)
    runner = StageRunner(stage, hook, comm.stages[layout.stage], device,
                         {e.value: bool(e.info.tensors and e.info.tensors[0].requires_grad)
                          for e in comm.edges})
    transport = DistTransport(comm, layout.pipeline_ranks, device, group=pipeline,
                              rank=layout.rank)
    data_parallel = _data_parallel_group(layout, stage)
    sync = None
    if data_parallel is not None:
        sync = GradientSync(layout.stage, list(stage.parameters()), data_parallel,
                            plan.dp_sync, pipeline)
        hook.register(lambda s: sync.on_stage_backward(s, hook.finishing))
    coordinator = DistCoordinator(layout.pipeline_ranks, micro_batches, device, pipeline,
                                  _tied_groups(pipe, layout), sync=sync,
                                  data_parallel=data_parallel, group_index=layout.group,
                                  groups=layout.groups)
    pipe.executor = PipelineExecutor(
        {layout.stage: runner}, comm, transport, _output_names(traced.gm), plan.schedule,
        micro_batches, traced.bind.unflatten, threads, coordinator,
    )
    return pipe


def _agree(layout, plan: Plan, units: Sequence[Unit]) -> None:
    """Every rank must compile the same plan for the same graph; say which ranks differ."""
    fingerprint = repr((sorted(plan.to_dict().items(), key=str), [u.nodes for u in units]))
    everyone: list[Any] = [None] * layout.world
    torch.distributed.all_gather_object(everyone, fingerprint)
    differ = [r for r, f in enumerate(everyone) if f != everyone[0]]
    if differ:
        raise PlanError(
            f"ranks {differ} compiled a different plan or model than rank 0; every rank must "
            "call fxpipe.compile with the same model class, example input shapes and Plan "
            "(or Plan.load the same saved plan)."
        )


def _pipeline_group(layout):
    """This rank's pipeline as a process group (the whole job when there is one pipeline)."""
    if layout.groups == 1:
        return None
    mine = None
    for group in range(layout.groups):  # every rank creates every group, in the same order
        ranks = [layout.rank_of(s, group) for s in range(layout.stages)]
        handle = torch.distributed.new_group(ranks)
        if layout.rank in ranks:
            mine = handle
    return mine


def _data_parallel_group(layout, stage) -> Any:
    """The ranks running this rank's stage in every pipeline group, as a process group; the
    stage's parameters and buffers start as group 0's (as DistributedDataParallel does)."""
    if layout.groups == 1:
        return None
    mine = None
    for s in range(layout.stages):  # every rank creates every group, in the same order
        ranks = layout.data_parallel_ranks(s)
        handle = torch.distributed.new_group(ranks)
        if s == layout.stage:
            mine = handle
    source = layout.data_parallel_ranks(layout.stage)[0]
    with torch.no_grad():
        for tensor in [*stage.parameters(), *stage.buffers()]:
            torch.distributed.broadcast(tensor.data, source, mine)
    return mine


def _tied_groups(pipe: CompiledPipeline, layout) -> list[tuple[torch.nn.Parameter, Any]]:
    """For each weight tied across stages, the process group of the ranks holding it; the
    copies start equal (broadcast from the first holder) and stay equal (summed gradients)."""
    tied = []
    for _, param, stages in pipe.shared_parameter_objects():
        for group in range(layout.groups):
            ranks = [layout.rank_of(s, group) for s in stages]
            handle = torch.distributed.new_group(ranks)
            if layout.rank in ranks:
                with torch.no_grad():
                    torch.distributed.broadcast(param.data, ranks[0], handle)
                tied.append((param, handle))
    return tied


def _threads_per_stage(devices: Sequence[str]) -> int:
    """Intra-op threads for each stage's worker: stages on the CPU share its threads evenly
    (more would oversubscribe the cores and slow every stage down)."""
    on_cpu = sum(torch.device(d).type == "cpu" for d in devices)
    return max(1, torch.get_num_threads() // max(on_cpu, 1))


def _output_names(gm: torch.fx.GraphModule) -> Any:
    """The model's flat output as a structure of value names; refuses outputs no stage makes."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in output.all_input_nodes:
        if node.op == "get_attr":
            raise FxpipeError(
                f"the model returns its attribute {node.target!r} as it is; fxpipe runs only "
                "computed outputs through the pipeline: return a tensor computed from it."
            )
    return torch.fx.map_arg(output.args[0], lambda n: n.name)


@dataclasses.dataclass(frozen=True)
class Replan:
    """What the last run's measured stage times say about the partition."""

    current: Partition  # the partition that ran, scored with the corrected costs
    proposed: Partition  # the best partition found with the corrected costs
    dispersion: float  # GroPipe's performance dispersion of the measured stage times
    threshold: float

    @property
    def changed(self) -> bool:
        return self.proposed.bounds != self.current.bounds

    @property
    def plan_sizes(self) -> list[int]:
        """Units per stage to compile with: Plan(partitioner=replan.plan_sizes, ...)."""
        return list(self.proposed.sizes)

    def __str__(self) -> str:
        head = (f"measured stage imbalance (performance dispersion) {self.dispersion:.1%}, "
                f"threshold {self.threshold:.0%}")
        old = (f"current  {list(self.current.sizes)}: predicted "
               f"{self.current.predicted_time * 1e3:.2f} ms with the measured costs")
        if not self.changed:
            return f"{head}\n{old}\nkeep the current partition"
        new = (f"proposed {list(self.proposed.sizes)}: predicted "
               f"{self.proposed.predicted_time * 1e3:.2f} ms "
               f"({self.proposed.partitioner}); compile with Plan(partitioner="
               f"{self.plan_sizes})")
        return f"{head}\n{old}\n{new}"


def replan(pipe: CompiledPipeline, threshold: float = 0.05,
           partitioner: str | None = None) -> Replan:
    """Feed the last run's measured per-stage times back into the cost table and, when the
    measured stages are imbalanced beyond `threshold` (GroPipe's dispersion test), propose the
    partition the plan's partitioner (or `partitioner`; 'balanced' for even/explicit plans)
    finds with the corrected costs. Never proposes one with a worse predicted step time."""
    events = pipe.last_trace()
    if not events:
        raise FxpipeError("replan() reads the last run's timeline: call pipe.step(x, target) "
                          "(or pipe(x) and backward) first.")
    measured = step_time(events, pipe.plan.stages).stages
    p = pipe.partition.micro_batches
    scale = np.ones(pipe.cost.units)
    for stage, timing in zip(pipe.partition.stages, measured):
        predicted = p * (stage.f + stage.b)
        start, end = stage.units
        if predicted > 0 and timing.compute > 0:
            scale[start:end] = timing.compute / predicted
    cost = dataclasses.replace(pipe.cost, f=pipe.cost.f * scale, b=pipe.cost.b * scale)
    busy = np.array([t.compute for t in measured])
    dispersion = float(np.abs(busy - busy.mean()).sum() / (len(busy) * busy.mean()))
    schedule = pipe.plan.schedule
    current = Partition.evaluate(cost, pipe.partition.bounds, p, pipe.partition.partitioner,
                                 schedule=schedule)
    name = partitioner or (pipe.plan.partitioner if isinstance(pipe.plan.partitioner, str)
                           and pipe.plan.partitioner != "even" else "balanced")
    if name not in _PARTITIONERS:
        name = "even"
    proposed = current
    if dispersion > threshold:
        found = _PARTITIONERS[name](cost, pipe.plan.stages, p)
        found = Partition.evaluate(cost, found.bounds, p, name, schedule=schedule)
        if found.predicted_time < current.predicted_time:
            proposed = found
    result = Replan(current, proposed, dispersion, threshold)
    print(result)
    return result


def available_partitioners() -> tuple[str, ...]:
    """The partitioner names this version of fxpipe can run."""
    return tuple(_PARTITIONERS)


def compare_partitioners(pipe: CompiledPipeline) -> dict[str, Partition]:
    """Every available partitioner's partition of `pipe`'s cost table, under its plan."""
    plan = pipe.plan
    results = {}
    for name, partitioner in _PARTITIONERS.items():
        if plan.costs == "none" and name in TIMED_PARTITIONERS:
            continue
        chosen = partitioner(pipe.cost, plan.stages, pipe.partition.micro_batches)
        bounds, _ = _exactly(chosen.bounds, plan.stages, pipe.cost, chosen.micro_batches)
        results[name] = Partition.evaluate(pipe.cost, bounds, chosen.micro_batches,
                                           name, schedule=plan.schedule)
    return results


def units_of(
    model: torch.nn.Module, example_inputs: Any, plan: Plan | None = None
) -> list[Unit]:
    """The units `compile` would cut `model` into (tracing options from `plan`, if given)."""
    plan = plan or Plan(stages=1)
    args, kwargs = _example(example_inputs, None)
    traced = trace(model, args, kwargs, plan, check=_shapes_on(args, kwargs))
    return cut_units(traced.gm, plan.unit_depth, traced.leaf_paths)


def _costs(gm, units, flat, plan: Plan, devices, link: Link,
           cache: ProfileCache | None, threads: int) -> CostTable:
    """The CostTable: measured per unit at the plan's micro-batch size(s), or structure only."""
    unit_graph, unit_table = split_stages(gm, units, range(1, len(units) + 1),
                                          [devices[0]] * len(units))
    names = [u.name for u in units]
    if plan.costs == "none":
        params, param_bytes = unit_parameters(unit_graph, len(units))
        zeros = [0.0] * len(units)
        return CostTable(zeros, zeros, zeros, zeros, [1.0], None, params, tuple(names),
                         param_bytes)
    batch = input_dims(flat).batch
    profile = profile_units(unit_graph, unit_table, flat, _profile_sizes(batch, plan),
                            devices[0], cache=cache, threads=threads)
    return cost_table(profile, link, batch, names)


def _profile_sizes(batch: int, plan: Plan) -> list[int]:
    """Micro-batch sizes to time: the plan's, or powers of two up to the batch for 'auto'."""
    if plan.micro_batches == "auto":
        return sorted({batch} | {2 ** k for k in range(batch.bit_length()) if 2 ** k <= batch})
    if plan.micro_batches > batch:
        raise PlanError(
            f"Plan(micro_batches={plan.micro_batches}) splits a batch of {batch} samples into "
            f"more micro-batches than samples; use micro_batches <= {batch}."
        )
    return [-(-batch // plan.micro_batches)]  # the largest micro-batch, ceil(B / p)


def _link(plan: Plan, devices: Sequence[str]) -> Link:
    if plan.link is not None:
        return Link(plan.link[0], plan.link[1], "plan")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return default_link(devices[0], devices[-1], distributed)


def _profile_cache(cache: bool | str | os.PathLike) -> ProfileCache | None:
    if cache is False:
        return None
    return ProfileCache(default_cache_dir() if cache is True else pathlib.Path(cache))


def _shapes_on(args: tuple, kwargs: Mapping[str, Any]):
    """The check a candidate graph must pass: it runs on the example and gets its shapes."""
    return lambda traced: annotate_shapes(traced.gm, traced.bind(args, kwargs))


def _example(example_inputs: Any, example_kwargs: Mapping[str, Any] | None):
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


def _devices(model: torch.nn.Module, plan: Plan) -> list[str]:
    """One device per stage: the plan's, or the device the model's parameters are on."""
    if plan.devices is None:
        first = next(iter(model.parameters()), None)
        device = str(first.device) if first is not None else "cpu"
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


def _check_stage_count(model: torch.nn.Module, plan: Plan, units: Sequence[Unit]) -> None:
    if plan.stages <= len(units):
        return
    names = ", ".join(u.name for u in units[:8]) + (", ..." if len(units) > 8 else "")
    finer = (" or cut finer with a larger Plan(unit_depth=...) or none"
             if plan.unit_depth is not None else "")
    raise PlanError(
        f"Plan(stages={plan.stages}) asks for more stages than {type(model).__name__} has "
        f"units: it cuts into {len(units)} units ({names}); use stages <= {len(units)}{finer}."
    )


def _partition(
    model: torch.nn.Module, plan: Plan, units: Sequence[Unit], cost: CostTable
) -> Partition:
    p = plan.micro_batches if isinstance(plan.micro_batches, int) else 1
    if plan.sizes is not None:
        if sum(plan.sizes) != len(units):
            raise PlanError(
                f"Plan(partitioner={list(plan.sizes)}) covers {sum(plan.sizes)} units, but "
                f"{type(model).__name__} has {len(units)} units; make the sizes add up to "
                f"{len(units)} (print(fxpipe.units_of(model, x)) lists them)."
            )
        bounds = torch.tensor(plan.sizes).cumsum(0).tolist()
        return Partition.evaluate(cost, bounds, p, "given", schedule=plan.schedule)
    if plan.partitioner not in _PARTITIONERS:
        raise PlanError(
            f"Plan(partitioner={plan.partitioner!r}) is not available in this version of "
            f"fxpipe; available: {', '.join(_PARTITIONERS)} or a list of units per stage."
        )
    if plan.micro_batches == "auto" and plan.partitioner != "csimd":
        p = _PARTITIONERS["csimd"](cost, plan.stages).micro_batches  # CSIMD's choice of p
    chosen = _PARTITIONERS[plan.partitioner](cost, plan.stages, p)
    bounds, name = _exactly(chosen.bounds, plan.stages, cost, chosen.micro_batches)
    return Partition.evaluate(cost, bounds, chosen.micro_batches,
                              name or chosen.partitioner, schedule=plan.schedule)


def _exactly(bounds: Sequence[int], stages: int, cost: CostTable, p: int):
    """IMD and cross-search may use fewer stages than asked when more would only add links;
    the plan has a device or rank per stage, so split the slowest stages until there are
    `stages` (each split at the unit that best halves its time)."""
    bounds = list(bounds)
    if len(bounds) >= stages:
        return tuple(bounds), None
    f, b, _, _ = cost.at(p)
    time = f + b
    while len(bounds) < stages:
        starts = [0, *bounds[:-1]]
        splittable = [(time[a:z].sum(), a, z) for a, z in zip(starts, bounds) if z - a > 1]
        _, start, end = max(splittable)
        halves = np.cumsum(time[start:end])
        cut = start + 1 + int(np.argmin(np.abs(halves[:-1] - halves[-1] / 2)))
        bounds = sorted([*bounds, cut])
    return tuple(bounds), None
