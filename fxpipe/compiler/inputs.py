"""The user's inputs checked before any work: examples, devices, batch split, stage count."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxpipe.batching import check_batch_norm, input_dims, resize
from fxpipe.errors import FxpipeError, PlanError
from fxpipe.ir import ValueRef
from fxpipe.materialize import has_meta_tensors, on_meta
from fxpipe.meta import SHAPE, ValueInfo
from fxpipe.passes.analysis.shape import annotate_shapes, record_values
from fxpipe.plan import Plan
from fxpipe.preserve import preserved_state
from fxpipe.trace import Traced, trace
from fxpipe.units import Unit, cut_units

__all__ = [
    "check_batched_inputs", "check_example_runs", "check_micro_batch_count",
    "check_per_sample_outputs", "check_stage_count",
    "check_stage_sizes", "check_whole_inputs",
    "example_args", "output_names", "shapes_on", "stage_devices", "units_of",
    "whole_positions",
]


def example_args(example_inputs: Any, example_kwargs: Mapping[str, Any] | None
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """compile's example as forward()'s positional and keyword arguments."""
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
    """One device per stage: the plan's device of the stage's place (`Plan.placement`), or the
    device the model's parameters are on (the CPU for a model on the meta device)."""
    if plan.devices is None:
        first = next(iter(model.parameters()), None)
        device = str(first.device) if first is not None and not first.is_meta else "cpu"
        return [device] * plan.stages
    named = list(plan.devices)
    for d, name in enumerate(plan.devices):
        device = torch.device(name)
        if device.type == "cuda":
            count = torch.cuda.device_count()
            index = device.index or 0
            if device.index is None and count:  # "cuda": the current one, named so that
                index = torch.cuda.current_device()  # stages on it compare equal to "cuda:i"
                named[d] = f"cuda:{index}"
            if index >= count:
                raise PlanError(
                    f"Plan(devices=...) names {name!r}, but this machine has {count} CUDA "
                    f"device{'s' if count != 1 else ''}; use "
                    f"devices={['cpu'] * plan.device_count} "
                    "to run every stage on the CPU."
                )
        elif device.type not in ("cpu", "meta") and not _backend_available(device.type):
            raise PlanError(f"Plan(devices=...) names {name!r}, but no {device.type} device "
                            "is available here.")
    return [named[d] for d in plan.placement]


def _backend_available(kind: str) -> bool:
    backend = getattr(torch, kind, None) or getattr(torch.backends, kind, None)
    return bool(backend is not None and getattr(backend, "is_available", lambda: False)())


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


def whole_positions(traced: Traced, plan: Plan, args: tuple, kwargs: Mapping[str, Any]
                    ) -> tuple[int, ...]:
    """Positions among the flat graph inputs of the arguments every micro-batch gets whole."""
    owners = traced.bind.argument_of_each_input(args, kwargs)
    return tuple(i for i, name in enumerate(owners) if name in plan.whole_inputs)


def check_batched_inputs(traced: Traced, plan: Plan, flat: Sequence[Any],
                         arguments: Sequence[str], whole: Sequence[int]) -> None:
    """Inputs whose first dimension equals the batch size are split into micro-batches; one
    that only happens to (a (T, T) mask when T == B) must be named in Plan(whole_inputs=...).
    Run the graph on half the batch: the outputs must shrink in their first dimension only.
    `flat`: the example as graph inputs; `arguments`: the forward() argument of each."""
    if plan.micro_batches == 1 and plan.groups == 1:
        return  # nothing is split
    owners, leaves, whole_leaves = [], [], []
    for i, (name, value) in enumerate(zip(arguments, flat)):
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


def shapes_on(args: tuple, kwargs: Mapping[str, Any]) -> Callable[[Traced], None]:
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


def check_stage_sizes(model: torch.nn.Module, plan: Plan, units: Sequence[Unit]) -> None:
    """Plan(partitioner=[...]) covers the units exactly."""
    if plan.sizes is not None and sum(plan.sizes) != len(units):
        raise PlanError(
            f"Plan(partitioner={list(plan.sizes)}) covers {sum(plan.sizes)} units, but "
            f"{type(model).__name__} has {len(units)} units; make the sizes add up to "
            f"{len(units)} (print(fxpipe.units_of(model, x)) lists them)."
        )


def check_micro_batch_count(plan: Plan, batch: int, timed: Sequence[int] = (),
                            batch_norm: str | None = None) -> None:
    """Every micro-batch of the example, which the units are timed on (`timed`: their sizes),
    holds a sample, and two if a batch norm layer in training gets one value per channel from
    a sample (`batch_norm`, described)."""
    if batch == 0:
        raise PlanError("compile's example batch is empty (its inputs have 0 rows); give one "
                        "mini-batch of samples as the example.")
    split = batch // plan.micro_batches if isinstance(plan.micro_batches, int) else batch
    check_batch_norm(batch_norm, min([*timed, split]), f"compile's example of {batch}, timed "
                     f"on micro-batches of {list(timed)} samples,",
                     batch // 2 if plan.costs != "fit" else batch // 4)
    if isinstance(plan.micro_batches, int) and plan.micro_batches > batch:
        raise PlanError(
            f"Plan(micro_batches={plan.micro_batches}) splits the example batch of {batch} "
            f"samples into more micro-batches than samples; the units are timed on its "
            f"micro-batches, so give a full mini-batch as the example, or micro_batches <= "
            f"{batch}."
        )


def check_per_sample_outputs(traced: Traced, plan: Plan, batch: int) -> list[int]:
    """Split batches' outputs are joined along dimension 0, so each needs a row per sample, or
    is one number (a loss the model computes, as HuggingFace models given labels=), added up
    by model_loss.scalar_joins; the positions of those in the flat output."""
    if plan.micro_batches == 1 and plan.groups == 1:  # nothing is split
        return []
    output = next(n for n in traced.gm.graph.nodes if n.op == "output")
    scalars = []
    for i, node in enumerate(pytree.tree_leaves(output.args[0])):
        tensors = node.meta[SHAPE].tensors if isinstance(node, torch.fx.Node) else ()
        if len(tensors) == 1 and len(tensors[0].shape) == 0:
            scalars.append(i)
            continue
        shape = next((t.shape for t in tensors if len(t.shape) == 0 or t.shape[0] != batch),
                     None)
        if shape is not None:
            raise PlanError(
                f"model output #{i} (shape {list(shape)}) has no row per sample of the example "
                f"batch of {batch}, so the outputs of its {plan.micro_batches} micro-batches "
                "cannot be joined: return a row per sample, or one number, or give "
                "Plan(micro_batches=1).")
    return scalars


def units_of(
    model: torch.nn.Module, example_inputs: Any, plan: Plan | None = None
) -> list[Unit]:
    """The units `compile` would cut `model` into (tracing options from `plan`, if given)."""
    plan = plan or Plan(stages=1)
    args, kwargs = example_args(example_inputs, None)
    traced = trace(model, args, kwargs, plan, check=shapes_on(args, kwargs))
    return cut_units(traced.gm, plan.unit_depth, traced.leaf_paths)


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
