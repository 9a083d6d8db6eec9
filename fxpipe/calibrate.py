"""Opt-in calibration: what a pipeline's actions take in real steps beyond its units' costs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from fxpipe.cost import Partition
from fxpipe.errors import FxpipeError
from fxpipe.ir import Event
from fxpipe.pipeline import CompiledPipeline
from fxpipe.predict import Calibration
from fxpipe.preserve import gradients_set_aside, preserved_state
from fxpipe.schedules import ActionKind
from fxpipe.simulate import WEIGHT_SHARE

__all__ = ["Calibration", "calibrate", "calibration_from", "check_flushed_training"]

K = ActionKind


def check_flushed_training(pipe: Any, name: str, does: str,
                           runs: str = "runs training steps, which need") -> None:
    """Refuse, naming `name`() and the fix, what cannot run flushed training steps: not a
    compiled pipeline, no loss function, or an asynchronous schedule."""
    if not isinstance(pipe, CompiledPipeline):
        raise FxpipeError(f"{name}() takes the pipeline fxpipe.compile returned, not "
                          f"{type(pipe).__name__}.")
    if pipe.plan.loss_fn is None:
        raise FxpipeError(f"{name}() {runs} Plan(loss_fn=...): "
                          "compile with a loss function.")
    if pipe.plan.schedule == "async-1f1b":
        raise FxpipeError(f"{name}() {does} (pipe.step); async-1f1b streams mini-batches: "
                          f"{name.split('_')[0]} a pipeline compiled with schedule='1f1b'.")


def calibrate(pipe: Any, *inputs: Any, target: Any, steps: int = 10, warmup: int = 2,
              clock: Callable[[], float] = time.perf_counter, **kwargs: Any) -> Calibration:
    """Run `warmup` + `steps` training steps of `pipe` on `inputs` (forward()'s arguments, as
    pipe.step takes them) and `target`, and measure what its actions take beyond its
    partition's predicted costs (`calibration_from`). The steps leave no gradient, buffer,
    random number generator or last run (what pipe.report() describes) changed. Use a batch
    like compile's example: the prediction is of its micro-batches. Under torchrun every rank
    calls it, as pipe.step."""
    check_flushed_training(pipe, "calibrate", "times flushed steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1 or \
            isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise FxpipeError(f"calibrate(steps={steps!r}, warmup={warmup!r}) takes steps >= 1 "
                          "and warmup >= 0, whole numbers.")
    walls, kept, executor = [], [], pipe.executor
    with preserved_state(pipe), gradients_set_aside(pipe), executor.runs_aside():
        for i in range(warmup + steps):
            start = clock()
            pipe.step(*inputs, target, **kwargs)
            wall = clock() - start
            if i >= warmup:
                walls.append(wall)
                kept.append((executor.last_trace(), executor.trace_origin))
        sizes = executor.last_sizes
    runs = executor.full_traces(kept)  # every stage's, under torchrun too
    return calibration_from(runs, walls, pipe.partition, sizes)


def calibration_from(runs: Sequence[Sequence[Event]], walls: Sequence[float],
                     partition: Partition, sizes: Sequence[int]) -> Calibration:
    """The calibration of steps whose every stage's events are `runs` (one list per step) and
    whose wall-clock seconds are `walls`, against `partition`'s predicted stage costs."""
    if not runs or len(runs) != len(walls):
        raise ValueError("calibration_from needs one wall-clock time per run, and a run")
    stages = len(partition.stages)
    took: dict[tuple[int, ActionKind], list[float]] = {}
    whole_b: dict[int, list[float]] = {}  # B of micro-batches with no W: the whole backward
    outside = []
    for events, wall in zip(runs, walls):
        split = {(e.stage, e.action.mb) for e in events if e.action.kind is K.W}
        for e in events:
            if e.action.kind is K.B and (e.stage, e.action.mb) not in split:
                whole_b.setdefault(e.stage, []).append(e.duration)
            else:
                took.setdefault((e.stage, e.action.kind), []).append(e.duration)
        span = (max(e.end for e in events) - min(e.start for e in events)) if events else 0.0
        outside.append(max(wall - span, 0.0))

    def beyond(stage: int, kind: ActionKind, predicted: float) -> float:
        measured = took.get((stage, kind))
        return statistics.median(measured) - predicted if measured else 0.0

    def backward(stage: int) -> float:
        """Per B action, against the stage's backward, or where the schedule split that
        micro-batch's, against B's share of it, as the simulator splits it (a stage may run
        both, as dualpipev's do)."""
        b = partition.stages[stage].b
        residuals = [t - b for t in whole_b.get(stage, [])] + \
            [t - b * (1 - WEIGHT_SHARE) for t in took.get((stage, K.B), [])]
        return statistics.median(residuals) if residuals else 0.0

    def weight(stage: int) -> float:
        """Per W action, against W's share of the stage's backward (0 without W)."""
        return beyond(stage, K.W, partition.stages[stage].b * WEIGHT_SHARE)

    def sending(stage: int) -> float:
        sends = took.get((stage, K.SEND_F), []) + took.get((stage, K.SEND_B), [])
        return statistics.median(sends) if sends else 0.0

    return Calibration(
        tuple(beyond(s, K.F, partition.stages[s].f) for s in range(stages)),
        tuple(backward(s) for s in range(stages)),
        tuple(sending(s) for s in range(stages)),
        statistics.median(outside), len(runs), tuple(sizes or ()), tuple(partition.bounds),
        tuple(weight(s) for s in range(stages)) if any(kind is K.W for _, kind in took) else (),
    )
