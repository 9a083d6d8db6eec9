"""Re-timing a compiled pipeline's units as compile did, to predict its step on the machine as
it is now."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from fxpipe.compile.front import example_args, measure_costs
from fxpipe.cost import Partition
from fxpipe.distributed import launched
from fxpipe.pipeline import CompiledPipeline

__all__ = ["Timing", "retime"]


@dataclasses.dataclass(frozen=True)
class Timing:
    """How compile timed the units: on which device, with how many threads, beside how many
    busy stages."""

    device: str
    threads: int
    concurrency: int


def retime(pipe: CompiledPipeline, example_inputs: Any,
           example_kwargs: Mapping[str, Any] | None = None, *, warmup: int = 2,
           repeats: int = 5) -> Partition:
    """The pipeline's partition scored with its units timed again, exactly as compile timed them
    (same micro-batch sizes, threads and concurrent stages; no cache). Under torchrun every rank
    must call it: they time at once and rank 0's table counts, as in compile. A shared
    machine's speed drifts over seconds, so a prediction meant to be compared with measured
    steps is best made from timings taken right beside them. `warmup`, `repeats`: runs of
    each unit, the median of the repeats counts."""
    timing: Timing | None = pipe.timing
    if timing is None:
        raise ValueError("retime() needs a pipeline made by fxpipe.compile")
    args, kwargs = example_args(example_inputs, example_kwargs)
    flat = pipe.traced.bind(args, kwargs)
    whole = pipe.executor.whole if pipe.executor is not None else ()
    plan = dataclasses.replace(pipe.plan, costs="measure") if pipe.plan.costs == "none" \
        else pipe.plan
    cost = measure_costs(pipe.traced.gm, pipe.units, flat, plan, [timing.device],
                         pipe.link, None, timing.threads, timing.concurrency, whole, warmup,
                         repeats)
    if launched():
        shared: list[Any] = [cost]
        torch.distributed.broadcast_object_list(shared, src=0)
        cost = shared[0]
    part = pipe.partition
    return Partition.evaluate(cost, part.bounds, part.micro_batches, part.partitioner,
                              schedule=pipe.plan.schedule)
