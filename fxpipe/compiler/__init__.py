"""compile(): a named list of passes over one Compilation, then the runtime built for it."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import torch

from fxpipe.compiler.assemble import build_local_runtime
from fxpipe.compiler.distributed import build_rank_runtime, owned_names
from fxpipe.compiler.inputs import example_args, units_of
from fxpipe.compiler.partitioning import compare_partitioners
from fxpipe.compiler.passes import PASSES
from fxpipe.compiler.replan import Replan, replan
from fxpipe.compiler.state import Compilation, PassLog, run_passes
from fxpipe.errors import FxpipeError
from fxpipe.passes.analysis.profile_cache import ProfileCache, default_cache_dir
from fxpipe.pipeline import CompiledPipeline
from fxpipe.plan import Plan
from fxpipe.preserve import modes_kept
from fxpipe.recompute_spec import stage_recompute

__all__ = ["PASSES", "PassLog", "Replan", "compare_partitioners", "compile", "replan", "units_of"]


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
    the inputs, as pipe.step takes the target): the plan's loss_fn is timed too, and counts
    in the last unit's costs, so the partition sees what the last stage computes in a step.
    `cache` keeps unit timings on disk (True: ~/.cache/fxpipe/profiles; a path; False: off);
    print(pipe) says where the times came from.

    The passes are `fxpipe.compiler.PASSES`, the same in one process and under torchrun (where
    each rank then holds only its own stage), printed with Plan(dump=True), kept in pipe.passes.

    A model built on the meta device (`with torch.device("meta"): model = Net()`) has each
    stage made real only on its own device (under torchrun: only this rank's stage), its
    values from the modules' reset_parameters(); load the weights with
    `pipe.load_state_dict(state_dict)`. Its units are timed on real copies, a run of
    consecutive units at a time. Its stage tensors are new objects, put in the model's place
    under every name; build optimizers after compile.
    """
    if not isinstance(model, torch.nn.Module):
        raise FxpipeError(f"compile() takes an nn.Module, got {type(model).__name__}.")
    if not isinstance(plan, Plan):
        raise FxpipeError(f"compile() takes an fxpipe.Plan, got {type(plan).__name__}; "
                          "e.g. fxpipe.Plan(stages=2).")
    args, kwargs = example_args(example_inputs, example_kwargs)
    c = Compilation(model, plan, args, kwargs, example_target, _profile_cache(cache))
    log = run_passes(PASSES, c)
    if c.distributed:
        executor, rank = build_rank_runtime(c), c.layout.rank
        owned = owned_names(c.model, [c.graph.get_submodule(f"stage{s}").module
                                      for s in c.layout.held])
    else:
        executor, owned, rank = build_local_runtime(c), None, None
    return CompiledPipeline(
        model, c.plan, traced=c.traced, units=c.units, partition=c.partition, graph=c.graph,
        comm=c.comm, devices=c.devices, cost=c.cost, link=c.link, executor=executor,
        passes=log, splits=c.splits, rank=rank, owned=owned,
        retrace=None if c.distributed or plan.intra_layer else _retracer(model, c, executor),
    )


def _retracer(model: torch.nn.Module, c: Compilation, executor: Any):
    """compile again from the model in another train/eval mode, for a graph that fixed its
    mode: the same stages and micro-batch count, nothing timed, and the same loss scaler."""
    plan = dataclasses.replace(c.plan, partitioner=list(c.partition.sizes), costs="none",
                               micro_batches=c.partition.micro_batches, dump=False,
                               memory_limit=None,  # the partition is the capped one already
                               recompute=list(stage_recompute(c.plan, c.partition)))
    args, kwargs = c.args, c.kwargs

    def retrace(mode: bool) -> CompiledPipeline:
        with modes_kept(model):
            twin = compile(model.train(mode), plan, args, kwargs, cache=False)
        twin.executor.scaler = executor.scaler  # one scale, whichever pipeline steps
        return twin
    return retrace


def _profile_cache(cache: bool | str | os.PathLike) -> ProfileCache | None:
    if cache is False:
        return None
    if cache is True:
        return ProfileCache(default_cache_dir())
    if isinstance(cache, (str, os.PathLike)):
        return ProfileCache(pathlib.Path(cache))
    raise FxpipeError(f"compile(cache={cache!r}) takes True (the default folder), False (no "
                      "cache) or a folder's path.")
