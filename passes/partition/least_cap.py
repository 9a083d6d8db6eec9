"""The smallest memory cap any partition fits, found fast: a DP over a band of stage widths."""

from __future__ import annotations

import numpy as np

from fxpipe.cost import CostTable, Partition
from fxpipe.memory import FIELDS, MemoryBudget
from fxpipe.segments import recompute_table

__all__ = ["frontier", "least_scale", "least_state_split", "row_terms", "state_split",
           "walk_fields"]

_WORK, _KEPT, _SEGMENT = (FIELDS.index(name) for name in ("workspace", "kept", "segment"))


def walk_fields(cost: CostTable, p: int) -> dict[str, np.ndarray]:
    """Per cut i (before unit i), what `stage_bytes` reads for a stage starting or ending
    there, and the saved bytes' prefix sums."""
    crossing, grads, crossing_saved, outputs = cost.crossing_bytes(p)
    at_cut = lambda v: np.concatenate([[0.0], v])  # noqa: E731  [i]: the cut before unit i
    return {"saved": np.concatenate([[0.0], np.cumsum(cost.saved_bytes(p))]),
            "crossing": at_cut(crossing), "grads": at_cut(grads),
            "crossing_saved": at_cut(crossing_saved), "outputs": np.float64(outputs)}


def row_terms(row: np.ndarray, fields: dict[str, np.ndarray], s: int, last: bool
              ) -> tuple[np.ndarray, np.ndarray]:
    """One step's coefficients (FIELDS' order) · StageBytes(a, e) but the workspace and a
    recomputing stage's segments (`RANGED`), as start(a) + end(e): the saved bytes' prefix
    sums and what crosses the two cuts."""
    saved, received, sent, sent_saved, received_grads, sent_grads = row[:6]
    start = -saved * fields["saved"]
    if s:  # the first stage receives nothing (its inputs are the caller's)
        start = start + received * fields["crossing"] + sent_grads * fields["grads"]
    end = saved * fields["saved"] + (sent * fields["outputs"] if last else (
        sent * fields["crossing"] + sent_saved * fields["crossing_saved"]
        + received_grads * fields["grads"]))
    return start, end


def frontier(rows: np.ndarray) -> np.ndarray:
    """The rows no other row is at least as large as everywhere (the bytes are >= 0, so the
    others never hold the maximum)."""
    rows = np.unique(np.round(rows, 12), axis=0)
    covered = np.all(rows[None, :, :] >= rows[:, None, :], axis=2)  # [i, j]: j >= i everywhere
    np.fill_diagonal(covered, False)
    return rows[~covered.any(axis=1)]


def least_scale(cost: CostTable, stages: int, p: int, budget: MemoryBudget
                ) -> tuple[float, tuple[int, ...], tuple[bool, ...]]:
    """What `capped.smallest_scale` finds (the least over partitions and allowed recompute
    settings of the largest stage memory / cap, the partition and settings), without the
    (K+1)² tables: the even split's ratio U bounds the optimum, and a stage's memory is at
    least its weights' share plus its saved bytes × the largest coefficient a step gives
    them, so only stages within that bound's widths are searched (O(N·K·width); where a
    stage may recompute, its segments' table `recompute_table` besides)."""
    modes, limits = budget.modes(stages), budget.limits(stages)
    fields = walk_fields(cost, p)
    kept = [budget.kept(cost.param_bytes, cost.weight_cast_bytes, stages, p, s)
            for s in range(stages)]
    work = cost.unit_workspace(p)
    units = cost.units
    # a recomputing stage's segments, per range (O(M·K²·w), once)
    chains = recompute_table(cost, p) if any(True in m for m in modes) else None
    even = tuple((i + 1) * units // stages for i in range(stages))  # any partition bounds it
    ratio = np.full(stages, np.inf)
    for r in (False, True):
        settings = tuple(r if r in m else m[0] for m in modes)
        part = Partition.evaluate(cost, even, p, recompute=settings, memory=budget)
        ratio = np.minimum(ratio, [s.memory / c for s, c in zip(part.stages, limits)])
    bound = float(ratio.max()) * (1 + 1e-9)
    rows = {(s, r): frontier(budget.terms(stages, p, s, r).sum(axis=1))
            for s in range(stages) for r in modes[s]}
    width = 1
    for (s, _), terms in rows.items():
        lower = kept[s] + terms[:, 0].max() * fields["saved"]  # nondecreasing in the end
        far = np.searchsorted(lower, lower + bound * limits[s], side="right") - 1
        width = max(width, int((far - np.arange(units + 1)).max()))
    width = min(width, units)
    # workspace over [a, a + j): ws[j][a]
    spans = np.full((width + 1, units + 1), -np.inf)
    for j in range(1, width + 1):
        spans[j, : units + 1 - j] = np.maximum(spans[j - 1, : units + 1 - j],
                                               work[j - 1: units])
    best = np.full(units + 1, np.inf)
    best[0] = -np.inf
    steps = []
    for s in range(stages):
        new = np.full(units + 1, np.inf)
        pick = np.zeros((units + 1, 2), dtype=np.int64)  # per end: width, mode index
        for m, r in enumerate(modes[s]):
            cost_s = np.full((width + 1, units + 1), -np.inf)  # [j, a]: stage [a, a + j)
            for row in rows[(s, r)]:
                start, end = row_terms(row, fields, s, s == stages - 1)
                start = np.broadcast_to(start - kept[s], (units + 1,))
                end = np.broadcast_to(end + kept[s], (units + 1,))
                for j in range(1, width + 1):
                    value = start[: units + 1 - j] + end[j:] + row[_WORK] * np.maximum(
                        spans[j, : units + 1 - j], 0.0)
                    if r:  # a recomputing stage's segments, of [a, a + j)
                        value = value + (row[_KEPT] * np.diagonal(chains[0], j)
                                         + row[_SEGMENT] * np.diagonal(chains[1], j))
                    np.maximum(cost_s[j, : units + 1 - j], value,
                               out=cost_s[j, : units + 1 - j])
            for j in range(1, width + 1):
                a = np.arange(units + 1 - j)
                valid = a > 0 if s else a == 0  # a later stage never starts at unit 0
                value = np.where(valid, np.maximum(best[a], cost_s[j, a] / limits[s]), np.inf)
                better = value < new[j:]
                new[j:][better] = value[better]
                pick[j:][better] = (j, m)
        steps.append(pick)
        best = new
    value = float(best[units])
    bounds, settings, e = [], [], units
    for s in range(stages - 1, -1, -1):
        j, m = steps[s][e]
        bounds.append(e)
        settings.append(modes[s][int(m)])
        e -= int(j)
    return value, tuple(reversed(bounds)), tuple(reversed(settings))



def state_split(state: np.ndarray, limits: np.ndarray, scale: float = 1.0
                ) -> tuple[int, ...] | None:
    """Bounds of a split of units holding `state` bytes each (weights, gradients, optimizer
    slots) into len(limits) contiguous non-empty stages, each stage's state within its limit
    x scale, or None when there is none: a necessary condition for any partition to fit, a
    stage holding at least its units' state. Reachable ends stage by stage, O(N K log K)."""
    held = np.concatenate([[0.0], np.cumsum(state)])
    units = len(state)
    reach = np.zeros(units + 1, dtype=bool)
    reach[0] = True
    history = []
    for limit in limits:
        room = limit * scale * (1 + 1e-9)  # a stage exactly at its cap fits
        first = np.searchsorted(held, held - room, side="left")  # the earliest start per end
        count = np.concatenate([[0], np.cumsum(reach)])  # [i]: reached ends before i
        history.append((reach, first))
        reach = count[np.arange(units + 1)] - count[first] > 0  # a reached start in [first, e)
        reach[0] = False
    if not reach[units]:
        return None
    bounds, end = [], units
    for reached, first in reversed(history):
        bounds.append(end)
        end = int(np.flatnonzero(reached[first[end]:end])[-1]) + int(first[end])
    return tuple(reversed(bounds))


def least_state_split(state: np.ndarray, limits: np.ndarray) -> tuple[int, ...]:
    """A `state_split` at the least scale (within 1e-9) any split needs: its stages' state is
    what the units' state alone needs of the caps, activations aside."""
    low = max(float(np.sum(state)) / float(np.sum(limits)), 1e-300)  # the stages' sum holds it
    high = max(float(np.sum(state)) / float(np.min(limits)), low)  # any split fits
    while high > low * (1 + 1e-9):
        middle = (low * high) ** 0.5
        low, high = ((low, middle) if state_split(state, limits, middle) is not None
                     else (middle, high))
    return state_split(state, limits, high)
