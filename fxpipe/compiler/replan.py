"""Re-planning from a measured run: stage times fed back into the cost table."""

from __future__ import annotations

import dataclasses

import numpy as np

from fxpipe.compiler.partitioning import (
    PARTITIONERS,
    evaluate_for_plan,
    exactly_n_stages,
    memory_budget,
)
from fxpipe.cost import Partition
from fxpipe.errors import FxpipeError
from fxpipe.passes.partition.ampa import dispersion as ampa_dispersion
from fxpipe.pipeline import CompiledPipeline
from fxpipe.report import step_time

__all__ = ["Replan", "replan"]


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
               f"{self.current.predicted_time * 1e3:.2f} ms with the measured costs (the "
               "stages' costs alone, as the planners score partitions)")
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
    if not isinstance(pipe, CompiledPipeline):
        raise FxpipeError(f"replan() takes the pipeline fxpipe.compile returned, not "
                          f"{type(pipe).__name__}.")
    if partitioner is not None and partitioner not in PARTITIONERS:
        raise FxpipeError(f"replan(partitioner={partitioner!r}) is not known; choose one of "
                          f"{', '.join(PARTITIONERS)}.")
    events = pipe.full_trace("replan()")
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
    dispersion = ampa_dispersion(busy)
    # scored as compile scores: the plan's schedule (built, where it places several stages per
    # device), memory counted for its optimizer
    current = evaluate_for_plan(cost, pipe.partition.bounds, p, pipe.partition.partitioner,
                                pipe.plan, pipe.partition)
    name = partitioner or (pipe.plan.partitioner if isinstance(pipe.plan.partitioner, str)
                           and pipe.plan.partitioner != "even" else "balanced")
    proposed = current
    if dispersion > threshold:
        memory = memory_budget(pipe.plan, p)  # the plan's memory cap holds here too
        found = PARTITIONERS[name](cost, pipe.plan.stages, p,  # imd, csimd: maybe fewer stages
                                   **({} if memory is None else {"memory": memory}))
        bounds = exactly_n_stages(found.bounds, pipe.plan.stages, cost, p)
        again = found.recompute if memory else pipe.partition.recompute  # chosen, or fixed
        found = evaluate_for_plan(cost, bounds, p, name, pipe.plan, again)
        if found.predicted_time < current.predicted_time:
            proposed = found
    result = Replan(current, proposed, dispersion, threshold)
    if pipe._speaks():  # rank 0 under torchrun, as pipe.report()
        print(result)
    return result
