"""The predicted timeline of a compiled pipeline's step: its partition's stage costs, its link
and, where given, a calibration's per-action overheads, played by the event simulator."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxpipe.cost import Link, Partition
from fxpipe.errors import FxpipeError
from fxpipe.ir import CommTable
from fxpipe.schedules import ActionKind, Schedule
from fxpipe.simulate import Timeline, simulate

if TYPE_CHECKING:
    from fxpipe.calibrate import Calibration

__all__ = ["predict_step"]


def predict_step(schedule: Schedule, partition: Partition, comm: CommTable, link: Link,
                 calibration: Calibration | None = None) -> Timeline:
    """`schedule` (lowered for `comm`'s edges) timed with `partition`'s per-micro-batch stage
    costs; a message on edge (src, dst) takes the cut after stage src's link time (cf, cb),
    its sender `link.per_message`; `calibration` adds its overheads to every action."""
    stages = partition.stages
    if calibration is not None and len(calibration.forward) != len(stages):
        raise FxpipeError(f"this calibration is of a pipeline of {len(calibration.forward)} "
                          f"stages, and this one has {len(stages)}: calibrate this pipeline "
                          "(fxpipe.calibrate(pipe, x, target=y)).")
    send_f = {(e.src, e.dst): stages[e.src].cf for e in comm.edges}
    send_b = {(e.src, e.dst): stages[e.src].cb for e in comm.edges}
    overhead = {(s, kind): link.per_message for s in range(len(stages))
                for kind in (ActionKind.SEND_F, ActionKind.SEND_B)}
    if calibration is not None:
        overhead.update(calibration.overheads())
    return simulate(schedule, [s.f for s in stages], [s.b for s in stages], send_f, send_b,
                    overhead=overhead)
