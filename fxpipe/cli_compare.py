"""The side-by-side tables of `fxpipe plan --compare [--schedules ...]`, and their options."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from fxpipe.compiler import compare_partitioners
from fxpipe.compiler.partitioning import compare_schedules
from fxpipe.errors import FxpipeError
from fxpipe.inspect import format_bytes, format_sizes, format_table
from fxpipe.plan import SCHEDULES, VIRTUAL, Plan
from fxpipe.schedules import build, peak_activations

__all__ = ["comma_separated", "compared_schedules", "partitioner_comparison",
           "schedule_comparison"]


def comma_separated(option: str, text: str) -> list[str]:
    """The names of a comma-separated `option`; FxpipeError for an empty one."""
    names = text.split(",")
    if not all(names):
        raise FxpipeError(f"{option} {text!r} has an empty name: separate the names with "
                          "single commas, e.g. even,balanced.")
    return names


def partitioner_comparison(pipe) -> str:
    """Every partitioner's partition of `pipe`'s cost table, as a table (--compare)."""
    rows, failed = [], {}
    for name, part in compare_partitioners(pipe, failed).items():
        slowest = max(s.f + s.b for s in part.stages)
        rows.append([name, format_sizes(part.sizes), part.micro_batches,
                     f"{part.predicted_time * 1e3:.2f}",
                     f"{part.bubble:.0%}", f"{slowest * 1e3:.2f}",
                     format_bytes(max(s.memory for s in part.stages))])
    header = ["partitioner", "units per stage", "p", "predicted ms", "bubble",
              "slowest stage ms", "max memory"]
    return (f"partitioners compared (same cost table, {pipe.plan.schedule_name}'s step; p: "
            "micro-batches, csimd chooses its own):\n" + format_table(header, rows)
            + "".join(f"\n{name}: does not fit: {why}" for name, why in failed.items()))


def compared_schedules(args: argparse.Namespace, plan: Plan) -> list[str]:
    """--schedules, checked before any work: known names a plan like `plan` takes, and only
    with --compare."""
    if args.schedules is None:
        return []
    if not args.compare:
        raise FxpipeError("--schedules compares schedules alongside the partitioners: add "
                          "--compare.")
    names = comma_separated("--schedules", args.schedules)
    unknown = [name for name in names if name not in SCHEDULES]
    if unknown:
        raise FxpipeError(f"--schedules: {', '.join(map(repr, unknown))} is not a schedule "
                          f"fxpipe plans for; choose among {','.join(SCHEDULES)}.")
    for name in names:  # Plan's own checks of the schedule, before anything is measured
        dataclasses.replace(plan, schedule=name)
    return names


def schedule_comparison(pipe, schedules: Sequence[str]) -> str:
    """The chosen partitioner's partition under each of `schedules`, as a table."""
    rows = []
    for name, part in compare_schedules(pipe, schedules).items():
        if part is None:  # no partition fits the memory cap under this schedule
            rows.append([name, "does not fit the memory cap", *"-----"])
            continue
        placed = {"devices": pipe.plan.device_count} if name in VIRTUAL else {}
        peaks = peak_activations(build(name, len(part.stages), part.micro_batches, **placed))
        rows.append([name, format_sizes(part.sizes), part.micro_batches,
                     f"{part.predicted_time * 1e3:.2f}", f"{part.bubble:.0%}",
                     "/".join(map(str, peaks)), format_bytes(max(s.memory for s in part.stages))])
    header = ["schedule", "units per stage", "p", "simulated ms", "bubble",
              "peak activations", "max memory"]
    partitioner = pipe.partition.partitioner
    return (f"schedules compared ({partitioner}'s partition for each; simulated on a chain of "
            "stages; peak activations: micro-batches held at once per stage; async-1f1b: per "
            "mini-batch of two streamed):\n" + format_table(header, rows))
