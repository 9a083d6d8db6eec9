"""What a planner says when no partition fits a memory cap: the stage that binds, the least cap."""

from __future__ import annotations

import numpy as np

from fxpipe.cost import CostTable, Partition
from fxpipe.memory import MemoryBudget

__all__ = ["format_bytes", "no_fit_message"]


def no_fit_message(cost: CostTable, p: int, budget: MemoryBudget, scale: float,
                   bounds: tuple[int, ...], again: tuple[bool, ...], every_count: bool = False
                   ) -> str:
    """Why no partition into len(bounds) stages fits: the stage of `bounds` (the partition
    needing the least, `scale` times the caps) that binds, what it holds, the smallest cap
    that would fit, and what else would help."""
    limits = budget.limits(len(bounds))
    need = [x.memory for x in Partition.evaluate(cost, bounds, p, recompute=again,
                                                 memory=budget).stages]
    s = int(np.argmax(np.asarray(need) / limits))
    start, end = (0, *bounds)[s], bounds[s]
    needed = _per_device([int(np.ceil(x * scale)) if np.isfinite(x) else None
                          for x in limits], budget.placement)
    how = ("recomputing: its messages, the values kept at its segments' cuts, and its "
           "largest segment's activations in its backward"
           if again[s] else f"its activations × up to {budget.held(len(bounds), p)[s]} "
           "micro-batches in flight, "
           "its messages and backward workspace")
    hint = ""
    if not budget.may_recompute and budget.cannot_recompute is None:  # else it cannot help
        hint = ", recompute='auto' (recomputes the forward of the stages that need it)"
    return (f"no partition into {len(bounds)} stages fits the memory cap "
            f"({format_bytes(limits[s])} on stage {s}) at {p} micro-batch(es): the partition "
            "needing the "
            f"least ({'+'.join(str(e - a) for a, e in zip((0, *bounds), bounds))} units) still "
            f"needs {format_bytes(need[s])} on stage {s} (units "
            f"{start}-{end - 1}: weights, gradients, optimizer state and {how}); give "
            f"memory_limit={_as_limit(needed)} "
            f"({format_bytes(max(x for x in needed if x))}) or more"
            + (" (a device's stages are capped at an equal share of its cap)"
               if budget.placement else "") + ", "
            f"more stages{hint}"
            + ("" if every_count else
               ", or more micro-batches (smaller ones hold fewer activation bytes)")
            + ("" if budget.cannot_recompute is None else
               f"; recomputation {budget.cannot_recompute.rstrip('.')}"))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _per_device(needed: list[int | None], placement: tuple[int, ...]) -> list[int | None]:
    """Per-stage caps as the per-device caps memory_limit takes: a device holding v stages
    gives each 1/v of its cap, so it needs v times its stages' largest."""
    if not placement:
        return needed
    share = len(placement) // (max(placement) + 1)
    devices: dict[int, int | None] = {}
    for d, x in zip(placement, needed):
        held = devices.get(d)
        devices[d] = None if x is None or (d in devices and held is None) else max(
            x * share, held or 0)
    return [devices[d] for d in sorted(devices)]


def _as_limit(needed: list[int | None]) -> str:
    if len(set(needed)) == 1:
        return f"{needed[0]} bytes"
    return "[" + ", ".join(str(x) for x in needed) + "] bytes (per device)"

