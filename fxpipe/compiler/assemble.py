"""After the passes: stages made real on their devices, and the one-process runtime."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fxpipe.compiler.inputs import output_names
from fxpipe.compiler.intra_layer import outline_split_stages
from fxpipe.compiler.state import Compilation
from fxpipe.errors import FxpipeError
from fxpipe.ir import tied_parameters
from fxpipe.materialize import materialize
from fxpipe.recompute_spec import stage_recompute
from fxpipe.runtime.executor import PipelineExecutor

__all__ = ["build_local_runtime", "materialize_stages", "model_names"]


def model_names(model: torch.nn.Module) -> dict[int, str]:
    """Each of the model's parameters' id -> its (first) name."""
    return {id(p): n for n, p in model.named_parameters()}


def materialize_stages(c: Compilation, which: Sequence[int]) -> None:
    """Give a meta model's stages `which` storage on their devices (fxpipe.materialize), under
    every name the model and the graphs have for their tensors; each stage's hook is rebound
    to its parameters (even where nothing was meta: a tied weight another stage made real is
    a new tensor too)."""
    for s in which:
        module = c.graph.get_submodule(f"stage{s}").module
        materialize(module, c.devices[s], holders=(c.model, c.graph, c.traced.gm))
        c.graph.get_submodule(f"hook{s}").rebind(dict(module.named_parameters()))


def build_local_runtime(c: Compilation) -> PipelineExecutor:
    """Every stage made real on its device, and an executor running them on worker threads."""
    stages = [c.graph.get_submodule(f"stage{s}") for s in range(c.plan.stages)]
    for name, _, holders in tied_parameters(stages, model_names(c.model)):
        places = sorted({torch.device(c.devices[s]) for s in holders}, key=str)
        if len(places) > 1:
            raise FxpipeError(
                f"weight {name!r} is used by stages {holders}, which are on "
                f"{', '.join(map(str, places))}; one Parameter cannot live on several devices "
                "in one process: put those stages on one device, or run one stage per rank "
                "under torchrun (tied weights' copies then get summed gradients)."
            )
    hooks = [c.graph.get_submodule(f"hook{s}") for s in range(c.plan.stages)]
    outline_split_stages(stages, hooks, c.splits)
    materialize_stages(c, range(c.plan.stages))
    for stage, device in zip(stages, c.devices):
        stage.to(device)
    return PipelineExecutor.local(
        stages, hooks, c.comm, c.devices, outputs=output_names(c.cut_from),
        schedule=c.schedule, forward_schedule=c.forward_schedule, streamed=c.streamed,
        unflatten=c.traced.bind.unflatten, whole=c.whole, timeout=c.plan.timeout or 300.0,
        scalar_joins=c.scalar_joins, precision=c.plan.precision,
        recompute=stage_recompute(c.plan, c.partition),
    )
