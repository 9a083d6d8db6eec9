"""Choosing among (partition, micro-batch count) pairs by a schedule's simulated step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from fxpipe.cost import CostTable, Partition, check_bounds, stage_costs_at
from fxpipe.passes.partition.balanced import TIE
from fxpipe.simulate import WEIGHT_SHARE

__all__ = ["SCORED_SCHEDULES", "best_by_schedule", "check_schedule_name", "step_lower_bounds"]

# The schedules a planner can score by name (one stage per device), and the mini-batches each
# streams in one simulated run: async-1f1b's step is its makespan over them / their count.
SCORED_SCHEDULES = {"gpipe": 1, "1f1b": 1, "async-1f1b": 2, "zb-h1": 1}
# the lists of these never split a backward into B and W
_WHOLE_BACKWARD = ("gpipe", "1f1b", "async-1f1b")
# a lower bound above the best step by less than this (relative) is float rounding, not a gap
_ROUNDING = 1e-9


def check_schedule_name(schedule: object, planner: str) -> str:
    """`schedule` if a planner can score it, else ValueError saying what it takes."""
    if not isinstance(schedule, str):
        raise ValueError(f"{planner} chooses the micro-batch count, which a Schedule of your own "
                         "fixes; give a schedule name or another partitioner")
    if schedule not in SCORED_SCHEDULES:
        raise ValueError(f"{planner} scores the schedules {', '.join(SCORED_SCHEDULES)}, not "
                         f"{schedule!r}")
    return schedule


def step_lower_bounds(cost: CostTable, bounds: Sequence[int], counts: Sequence[int],
                      schedule: str) -> np.ndarray:
    """Per micro-batch count p in `counts`, a lower bound on the step `Partition.evaluate`
    simulates for `bounds` under `schedule` (on a chain, one stage per device), in one numpy
    pass.

    Stage s starts no earlier than a micro-batch's forward reaches it, head_s = Σ_{t<s} (f_t +
    cf_t), and computes p·(f_s + b_s) in all. By the end of its last B it has run every F and
    every B (a B being b_s·(1 − w) where the backward splits, w = WEIGHT_SHARE, 0 for schedules
    that never split it); after it, that micro-batch's gradient still passes back through the
    earlier stages' B and links, and stage 0's W: Σ_{t<s} (b_t·(1 − w) + cb_t) + w·b_0. So the
    step is at least max_s max(head_s + p(f_s + b_s), head_s + p(f_s + b_s(1 − w)) + tail_s).
    For balanced stages without links it is the 1F1B step itself (and ZB-H1's where F, B and W
    take the same time), so it prunes well.
    """
    streams = SCORED_SCHEDULES[schedule]
    w = 0.0 if schedule in _WHOLE_BACKWARD else WEIGHT_SHARE
    counts = np.asarray(counts, dtype=np.float64)
    stage_f, stage_b, cf, cb = stage_costs_at(cost, bounds, counts)
    link_f, link_b = np.zeros_like(stage_f), np.zeros_like(stage_b)  # none after the last
    link_f[:, :-1], link_b[:, :-1] = cf, cb
    head = np.cumsum(stage_f + link_f, axis=1) - (stage_f + link_f)
    tail = np.cumsum(stage_b * (1 - w) + link_b, axis=1) - (stage_b * (1 - w) + link_b)
    tail[:, 1:] += w * stage_b[:, :1]
    m = (counts * streams)[:, None]  # micro-batches a stage runs in the simulated run
    busy = head + m * (stage_f + stage_b)
    drained = head + m * (stage_f + stage_b * (1 - w)) + tail
    return np.maximum(busy, drained).max(axis=1) / streams


def best_by_schedule(cost: CostTable, partitions: Iterable[Sequence[int]], counts: Sequence[int],
                     schedule: str, start: Partition) -> Partition:
    """Of `start` and every pair (bounds, p) of `partitions` × `counts`, the one whose
    simulated step under `schedule` is the least: `start` unless another is shorter by more
    than TIE (relative), then the first such in (lower bound, bounds, p) order.

    Exact over the pairs, and fast: pairs are simulated in the order of their lower bounds
    (`step_lower_bounds`), and the search stops at the first bound that reaches the best
    simulated step, as no later pair can beat it.
    """
    best = Partition.evaluate(cost, start.bounds, start.micro_batches, start.partitioner,
                              schedule=schedule)
    pairs = sorted((float(bound), bounds, int(p))
                   for bounds in {check_bounds(x, cost.units) for x in partitions}
                   for p, bound in zip(counts, step_lower_bounds(cost, bounds, counts, schedule)))
    for bound, bounds, p in pairs:
        if bound * (1 - _ROUNDING) >= best.predicted_time * (1 - TIE):
            break
        tried = Partition.evaluate(cost, bounds, p, start.partitioner, schedule=schedule)
        if tried.predicted_time < best.predicted_time * (1 - TIE):
            best = tried
    return best
