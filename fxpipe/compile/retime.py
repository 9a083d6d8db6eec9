"""Re-timing a compiled pipeline's units as compile did, to predict its step on the machine as
it is now."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from fxpipe.compile.front import example_args, measure_costs
from fxpipe.compile.loss import traced_loss
from fxpipe.cost import Partition
from fxpipe.distributed import launched
from fxpipe.errors import FxpipeError
from fxpipe.passes.analysis.profile import DEFAULT_LOAD, MIN_TIMED
from fxpipe.pipeline import CompiledPipeline

__all__ = ["Timing", "retime"]


@dataclasses.dataclass(frozen=True)
class Timing:
    """How compile timed the units: on which device, with how many threads, with how many
    stage threads busy (profile_units' `concurrency`), running what (its `load`), and what
    share of the model's weights that device holds in the pipeline (a meta model's units are
    timed with no more of them real at once)."""

    device: str
    threads: int
    concurrency: int
    load: str = DEFAULT_LOAD
    held: float = 1.0


def retime(pipe: CompiledPipeline, example_inputs: Any,
           example_kwargs: Mapping[str, Any] | None = None, *, target: Any = None,
           warmup: int = 2, repeats: int = 5, min_time: float = MIN_TIMED) -> Partition:
    """The pipeline's partition scored with its units timed again, as compile timed them (same
    micro-batch sizes, threads and concurrent stages; no cache). Under torchrun every rank
    must call it: they time at once and rank 0's table counts, as in compile; and, as each
    rank holds and runs one stage, each stage's units are timed as a run of their own (their
    forwards, then their backwards: `benchmarks/compute_times.py` shows the first stage's
    forwards in the steps faster than timed in turn with the whole model's). A shared
    machine's speed drifts over seconds, so a prediction meant to be compared with measured
    steps is best made from timings taken right beside them. `target` (one row per sample of
    the inputs): the plan's loss_fn is timed too, on the last stage, where pipe.step runs it
    (as compile does only when given example_target). `warmup`, `repeats`: runs of each unit, the
    median of the repeats counts; more repeats until they took `min_time` seconds."""
    if not isinstance(pipe, CompiledPipeline):
        raise FxpipeError(f"retime() takes the pipeline fxpipe.compile returned, not "
                          f"{type(pipe).__name__}.")
    if pipe.timing is None:
        raise FxpipeError("retime() times the units as compile did, and this pipeline was not "
                          "made by fxpipe.compile: compile it with example inputs.")
    timing: Timing = pipe.timing
    args, kwargs = example_args(example_inputs, example_kwargs)
    flat = pipe.traced.bind(args, kwargs)
    whole = pipe.executor.whole if pipe.executor is not None else ()
    loss = traced_loss(pipe.traced, pipe.plan, target, flat, whole, timing.device,
                       "retime(target=...)")
    plan = dataclasses.replace(pipe.plan, costs="measure") if pipe.plan.costs == "none" \
        else pipe.plan
    stages = [range(*stage.units) for stage in pipe.partition.stages] if launched() else ()
    cost = measure_costs(pipe.traced.gm, pipe.units, flat, plan, [timing.device],
                         pipe.link, None, timing.threads, timing.concurrency, whole, warmup,
                         repeats, loss, min_time, timing.load, timing.held, stages)
    if launched():
        shared: list[Any] = [cost]
        torch.distributed.broadcast_object_list(shared, src=0)
        cost = shared[0]
    part = pipe.partition
    return Partition.evaluate(cost, part.bounds, part.micro_batches, part.partitioner,
                              schedule=pipe.plan.schedule)
