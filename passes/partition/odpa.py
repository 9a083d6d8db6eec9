"""`odpa`: CSIMD's optimal micro-batch count for a fixed partition (ALGORITHMS §4, CSIMD Alg. 4)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fxpipe.cost import CostTable, Partition, step_times

__all__ = ["divisors", "odpa"]


def divisors(batch: int) -> list[int]:
    """The micro-batch counts that split a mini-batch of `batch` samples evenly."""
    if isinstance(batch, bool) or int(batch) != batch or batch < 1:
        raise ValueError(f"batch={batch!r} must be a positive integer mini-batch size")
    small = np.arange(1, int(np.sqrt(batch)) + 1)
    small = small[batch % small == 0]
    return sorted({*small.tolist(), *(batch // small).tolist()})


def odpa(
    cost: CostTable, partition_or_bounds: Partition | Sequence[int], candidates: Sequence[int]
) -> tuple[int, np.ndarray]:
    """The micro-batch count in `candidates` with the least T(λ, p), and T for every candidate.

    One numpy evaluation of the closed form for all candidates (`step_times`); ties go to the
    candidate listed first. The per-unit costs at each p come from the table's interpolation
    in the micro-batch size, never from f(p) = f(1)/p.
    """
    bounds = getattr(partition_or_bounds, "bounds", partition_or_bounds)
    counts = np.asarray(candidates)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError("odpa needs a non-empty list of candidate micro-batch counts")
    if np.any(counts < 1) or np.any(counts != np.round(counts)):
        raise ValueError(f"candidate micro-batch counts must be positive integers, got {counts}")
    times = step_times(cost, bounds, counts)
    return int(counts[int(np.argmin(times))]), times
