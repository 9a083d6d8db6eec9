"""Plan versus reality: where a measured step's time went, next to the predicted step."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

from fxpipe.errors import FxpipeError
from fxpipe.inspect import format_bytes, format_table
from fxpipe.inspect import format_ms as _ms
from fxpipe.ir import Event
from fxpipe.schedules import ActionKind

__all__ = ["MeasuredMemory", "StageTime", "StepTime", "check_measured", "format_memory",
           "format_report", "step_time", "unlike_prediction_lines"]

_COMPUTE = {ActionKind.F, ActionKind.B, ActionKind.W}
_COMM = {ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B}
_REDUCE = {ActionKind.ALLREDUCE, ActionKind.STEP}


@dataclasses.dataclass(frozen=True)
class StageTime:
    """One stage's share of a step, in seconds."""

    stage: int
    forward: float  # mean forward time per micro-batch
    backward: float  # mean backward time per micro-batch (B, and W where split off)
    compute: float  # all its F, B, W
    communication: float  # time spent in sends and waiting in receives
    reduction: float  # all-reduces and optimizer steps
    idle: float  # the rest of the step


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A whole step: its length and each stage's breakdown; `placement[s]` is stage s's device
    (several stages share one under interleaved 1F1B, looped BFS and ZB-V)."""

    makespan: float
    stages: tuple[StageTime, ...]
    placement: tuple[int, ...] = ()  # () : stage s on device s

    @property
    def devices(self) -> int:
        return len(set(self.placement)) if self.placement else len(self.stages)

    @property
    def bubble(self) -> float:
        """Share of device time not spent computing (the simulator's definition)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(s.compute for s in self.stages) / (self.devices * self.makespan)

    def share(self, field: str) -> float:
        """`field`'s share of all device time: a device's idle time counts once, however many
        stages it runs (each of its stages' rows shows it)."""
        total = self.devices * self.makespan
        if total <= 0:
            return 0.0
        if field == "idle":
            return sum({self.device(s.stage): s.idle for s in self.stages}.values()) / total
        return sum(getattr(s, field) for s in self.stages) / total

    def device(self, stage: int) -> int:
        return self.placement[stage] if self.placement else stage

    @property
    def bounding_stage(self) -> int:
        """The stage with the most compute: the one the pipeline waits for."""
        return max(self.stages, key=lambda s: s.compute).stage


def step_time(events: Sequence[Event], stages: int,
              placement: Sequence[int] | None = None) -> StepTime:
    """Break a timeline (measured or simulated) down per stage. `placement[s]`: stage s's
    device where several stages share one; a stage's idle time is then its device's, the
    time none of the device's stages computes, sends, receives or reduces."""
    placement = tuple(placement) if placement is not None else ()
    if not events:
        return StepTime(0.0, tuple(StageTime(s, 0, 0, 0, 0, 0, 0) for s in range(stages)),
                        placement)
    start = min(e.start for e in events)
    makespan = max(e.end for e in events) - start
    rows = []
    for s in range(stages):
        mine = [e for e in events if e.stage == s]
        forward = [e.duration for e in mine if e.action.kind is ActionKind.F]
        backward = [e.duration for e in mine if e.action.kind is ActionKind.B]
        weight = sum(e.duration for e in mine if e.action.kind is ActionKind.W)
        compute = sum(e.duration for e in mine if e.action.kind in _COMPUTE)
        comm = sum(e.duration for e in mine if e.action.kind in _COMM)
        reduction = sum(e.duration for e in mine if e.action.kind in _REDUCE)
        rows.append(StageTime(
            s, statistics.fmean(forward) if forward else 0.0,
            # a micro-batch's backward: its B, and its W where the schedule split it off
            statistics.fmean(backward) + weight / len(backward) if backward else 0.0, compute,
            comm, reduction, 0.0))
    step = StepTime(makespan, tuple(rows), placement)
    busy: dict[int, float] = {}  # per device: the time its stages are doing anything
    for row in rows:
        device = step.device(row.stage)
        busy[device] = busy.get(device, 0.0) + row.compute + row.communication + row.reduction
    return dataclasses.replace(step, stages=tuple(
        dataclasses.replace(row, idle=max(makespan - busy[step.device(row.stage)], 0.0))
        for row in rows))


def format_report(measured: StepTime, predicted: StepTime, schedule: str,
                  outside: float | None = None, notes: Sequence[str] = ()) -> str:
    """Predicted against measured, per stage and in total, and what bounds the pipeline.
    `outside`: a calibration's seconds per step outside the schedule's actions, added to the
    predicted step (None: not calibrated); `notes`: lines shown right below the first
    (`unlike_prediction_lines`)."""
    total = predicted.makespan + (outside or 0.0)
    ratio = measured.makespan / total if total > 0 else float("nan")
    rows = [[m.stage, f"{_ms(m.forward)} / {_ms(p.forward)}",
             f"{_ms(m.backward)} / {_ms(p.backward)}", f"{_ms(m.compute)} / {_ms(p.compute)}",
             _share(m.compute, measured), _share(m.communication, measured),
             _share(m.reduction, measured), _share(m.idle, measured)]
            for m, p in zip(measured.stages, predicted.stages)]
    header = ["stage", "fwd ms meas/pred", "bwd ms meas/pred", "compute ms meas/pred",
              "compute", "send/recv+wait", "all-reduce+step", "idle"]
    bound = measured.bounding_stage
    calibrated = (f" ({_ms(predicted.makespan)} ms of actions + {_ms(outside)} ms outside "
                  "them, calibrated)" if outside is not None else "")
    return "\n".join([
        f"step ({schedule}): measured {_ms(measured.makespan)} ms, predicted {_ms(total)} ms"
        f"{calibrated} (measured / predicted = {ratio:.2f})",
        *notes,
        format_table(header, rows),
        f"bubble: measured {measured.bubble:.0%}, predicted {predicted.bubble:.0%}; "
        f"sends and receives {measured.share('communication'):.0%} (with the waits for a "
        f"message) and idle {measured.share('idle'):.0%} of all "
        f"{'stage' if measured.devices == len(measured.stages) else 'device'} time",
        f"bounding stage: {bound} (computes {_ms(measured.stages[bound].compute)} ms of the "
        f"{_ms(measured.makespan)} ms step)",
    ])


def unlike_prediction_lines(predicted: Sequence[int] | None, ran: Sequence[int],
                            backward: bool) -> list[str]:
    """What to tell a user whose last run is not the step the prediction is of: micro-batches
    of other sizes than `predicted` (compile's example; None: not known), or forwards
    without their backwards."""
    lines = []
    # several mini-batches' micro-batches one after another (pipe.step_many): each as predicted
    repeats = len(ran) // len(predicted) if predicted else 0
    if predicted is not None and ran and list(predicted) * max(repeats, 1) != list(ran):
        lines.append(f"not the predicted run: its micro-batches held {_samples(ran)}, the "
                     f"prediction's (compile's example) {_samples(predicted)}; compile with "
                     "an example of the batch you run to predict it")
    if not backward:
        lines.append("not the predicted run: it ran forwards only, and the prediction is of a "
                     "training step, forwards and backwards")
    return lines


def _samples(sizes: Sequence[int]) -> str:
    if len(set(sizes)) == 1:
        return f"{sizes[0]} sample{'s' if sizes[0] != 1 else ''} each"
    return f"{', '.join(map(str, sizes))} samples"


def _share(part: float, step: StepTime) -> str:
    return f"{part / step.makespan:.0%}" if step.makespan > 0 else "-"


@dataclasses.dataclass(frozen=True)
class MeasuredMemory:
    """Per stage, bytes at its peak in one training step (pipe.step): its parameters and
    buffers, gradients and optimizer state counted from the tensors, and `activations`, the
    step's measured peak above what the stage's device held when the step began (what autograd
    saves, boundary buffers, transient workspace, the loss on the last stage)."""

    weights: tuple[float, ...]
    gradients: tuple[float, ...]
    optimizer: tuple[float, ...]
    activations: tuple[float, ...]
    how: str  # what measured the activations

    @property
    def totals(self) -> tuple[float, ...]:
        return tuple(float(sum(parts)) for parts in
                     zip(self.weights, self.gradients, self.optimizer, self.activations))


def format_memory(predicted: Sequence[float], measured: MeasuredMemory) -> str:
    """Per stage, the predicted peak beside the measured one and their ratio, and what the
    measured one is made of."""
    rows = []
    for s, (pred, meas) in enumerate(zip(predicted, measured.totals)):
        rows.append([s, format_bytes(pred), format_bytes(meas),
                     f"{pred / meas:.2f}" if meas > 0 else "-",
                     format_bytes(measured.weights[s] + measured.gradients[s]),
                     format_bytes(measured.optimizer[s]), format_bytes(measured.activations[s])])
    header = ["stage", "memory pred", "memory meas", "pred/meas", "meas: weights+grads",
              "optimizer", "activations"]
    note = ([] if any(measured.optimizer) else [
        "no optimizer state counted (fxpipe.measure_memory(..., optimizer=...) counts it); the "
        "prediction counts Adam's two copies of the weights"])
    return "\n".join([f"peak memory per stage, predicted and measured ({measured.how}):",
                      format_table(header, rows), *note])


def check_measured(memory: object) -> None:
    """Refuse, before any work, a `memory` that is not fxpipe.measure_memory's (None is fine)."""
    if memory is not None and not isinstance(memory, MeasuredMemory):
        raise FxpipeError(f"pipe.report(memory=...) takes what fxpipe.measure_memory(pipe, x, "
                          f"target=y) returns, not {memory!r}.")
