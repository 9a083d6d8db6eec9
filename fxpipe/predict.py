"""The predicted step of a compiled pipeline: stage costs, link and calibration, simulated."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fxpipe.cost import Link, Partition
from fxpipe.errors import FxpipeError
from fxpipe.ir import CommTable
from fxpipe.schedules import ActionKind, Schedule
from fxpipe.simulate import Timeline, simulate

__all__ = ["Calibration", "predict_step"]

K = ActionKind


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Per stage, seconds each action took beyond what the partition predicts for it (medians
    over the calibration's steps and micro-batches; below 0 where a stage ran faster than its
    units timed one by one), and the step's own time outside its actions: what a step pays
    beyond its units' times (docs/cost-model.md, "Calibration").
    """

    forward: tuple[float, ...]  # per F action, beyond the stage's predicted forward
    backward: tuple[float, ...]  # per B action, beyond the stage's predicted backward (its
    # share of it where the schedule splits the backward)
    send: tuple[float, ...]  # per SEND action: the stage's time to hand a message over
    step: float  # per step, outside the span of its actions (splitting, starting the workers)
    steps: int  # how many steps were measured
    sizes: tuple[int, ...]  # the micro-batch sizes the steps ran (samples)
    bounds: tuple[int, ...]  # the partition it was measured against
    # per W action, beyond its share of the stage's backward (apart from B's: a first stage's
    # B has no input gradient to compute, and its W is the whole backward); () for backward's
    weight: tuple[float, ...] = ()

    def overheads(self) -> dict[tuple[int, ActionKind], float]:
        """The simulator's per-action overhead table (simulate(overhead=...))."""
        table = {}
        weight = self.weight or self.backward
        for s, (f, b, w, send) in enumerate(zip(self.forward, self.backward, weight,
                                                self.send)):
            table.update({(s, K.F): f, (s, K.B): b, (s, K.W): w, (s, K.SEND_F): send,
                          (s, K.SEND_B): send})
        return table

    def __str__(self) -> str:
        def us(values: Sequence[float]) -> str:
            return "/".join(f"{v * 1e6:+.0f}" for v in values)

        return (f"calibration over {self.steps} steps: per action beyond the stage's predicted "
                f"cost, forward {us(self.forward)} us, backward {us(self.backward)} us"
                + (f", weight gradient {us(self.weight)} us" if self.weight else "") + "; per "
                f"message sent {us(self.send)} us (per stage); per step outside its actions "
                f"{self.step * 1e3:.2f} ms")


def predict_step(schedule: Schedule, partition: Partition, comm: CommTable, link: Link,
                 calibration: Calibration | None = None) -> Timeline:
    """`schedule` (lowered for `comm`'s edges) timed with `partition`'s per-micro-batch stage
    costs; a message on edge (src, dst) takes the cut after stage src's link time (cf, cb),
    and its sender `link.per_message` per tensor it holds (a send is one per tensor);
    `calibration`, measured against this partition, adds its overheads to every action in
    place of the link's sending time."""
    stages = partition.stages
    if calibration is not None and calibration.bounds != partition.bounds:
        raise FxpipeError(f"this calibration was measured on the partition with stage ends "
                          f"{list(calibration.bounds)}, and this pipeline's are "
                          f"{list(partition.bounds)}: calibrate this pipeline "
                          "(fxpipe.calibrate(pipe, x, target=y)).")
    send_f = {(e.src, e.dst): stages[e.src].cf for e in comm.edges}
    send_b = {(e.src, e.dst): stages[e.src].cb for e in comm.edges}
    if calibration is not None:
        overhead = calibration.overheads()
    else:  # the activations' tensors, and the gradients of those that carry one
        carries, overhead = comm.carries_grad(), {}
        for e in comm.edges:
            forward, backward = (e.src, K.SEND_F, e.dst), (e.dst, K.SEND_B, e.src)
            overhead[forward] = overhead.get(forward, 0.0) + link.per_message
            gradient = carries[e.value] and e.info.tensors[0].dtype.is_floating_point
            overhead[backward] = overhead.get(backward, 0.0) + link.per_message * gradient
    return simulate(schedule, [s.f for s in stages], [s.b for s in stages], send_f, send_b,
                    overhead=overhead)
