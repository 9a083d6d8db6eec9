"""Plan versus reality: where a measured step's time went, next to the predicted step."""

from __future__ import annotations

import bisect
import dataclasses
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from fxpipe.inspect import format_table
from fxpipe.schedules import Action, ActionKind
from fxpipe.simulate import Event

if TYPE_CHECKING:
    from fxpipe.passes.analysis.capacity import ThreadCapacity

__all__ = ["LATE_AFTER", "Interference", "LateMessages", "StageTime",
           "StepTime", "format_report", "interference", "late_messages", "message_delays",
           "receive_waits",
           "shared_cores_lines", "step_time", "unlike_prediction_lines"]

_COMPUTE = {ActionKind.F, ActionKind.B, ActionKind.W}
_COMM = {ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B}
_REDUCE = {ActionKind.ALLREDUCE, ActionKind.STEP}
_RECV = {ActionKind.RECV_F, ActionKind.RECV_B}
_SEND = {ActionKind.SEND_F, ActionKind.SEND_B}
LATE_AFTER = 0.5e-3  # seconds beyond the predicted delay that make a message late


@dataclasses.dataclass(frozen=True)
class StageTime:
    """One stage's share of a step, in seconds."""

    stage: int
    forward: float  # mean forward time per micro-batch
    backward: float  # mean backward time per micro-batch
    compute: float  # all its F, B, W
    communication: float  # time spent in sends and waiting in receives
    reduction: float  # all-reduces and optimizer steps
    idle: float  # the rest of the step


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A whole step: its length and each stage's breakdown."""

    makespan: float
    stages: tuple[StageTime, ...]

    @property
    def bubble(self) -> float:
        """Share of stage time not spent computing (the simulator's definition)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(s.compute for s in self.stages) / (len(self.stages) * self.makespan)

    def share(self, field: str) -> float:
        total = len(self.stages) * self.makespan
        return sum(getattr(s, field) for s in self.stages) / total if total > 0 else 0.0

    @property
    def bounding_stage(self) -> int:
        """The stage with the most compute: the one the pipeline waits for."""
        return max(self.stages, key=lambda s: s.compute).stage


def step_time(events: Sequence[Event], stages: int) -> StepTime:
    """Break a timeline (measured or simulated) down per stage."""
    if not events:
        return StepTime(0.0, tuple(StageTime(s, 0, 0, 0, 0, 0, 0) for s in range(stages)))
    start = min(e.start for e in events)
    makespan = max(e.end for e in events) - start
    rows = []
    for s in range(stages):
        mine = [e for e in events if e.stage == s]
        forward = [e.duration for e in mine if e.action.kind is ActionKind.F]
        backward = [e.duration for e in mine if e.action.kind is ActionKind.B]
        compute = sum(e.duration for e in mine if e.action.kind in _COMPUTE)
        comm = sum(e.duration for e in mine if e.action.kind in _COMM)
        reduction = sum(e.duration for e in mine if e.action.kind in _REDUCE)
        rows.append(StageTime(
            s, statistics.fmean(forward) if forward else 0.0,
            statistics.fmean(backward) if backward else 0.0, compute, comm, reduction,
            max(makespan - compute - comm - reduction, 0.0),
        ))
    return StepTime(makespan, tuple(rows))


@dataclasses.dataclass(frozen=True)
class Interference:
    """How much longer one kind of compute action took while another stage computed than while
    none did, in a measured timeline: the stages share the machine's cores (and, as threads of
    one process, Python's interpreter lock), which a prediction from units timed one way
    cannot follow both ways."""

    kind: ActionKind
    ratio: float  # per stage, median time beside / median time without; geometric mean
    beside: int  # actions that spent over half their time beside another stage's compute
    without: int  # actions that did not (on the stages counted in `ratio`)


def interference(events: Sequence[Event]) -> list[Interference]:
    """Per compute kind (F, B): the slowdown of the actions that ran beside another stage's
    compute (over half their time while at least one other stage computed), from the stages
    that ran that kind both ways (none where no stage did)."""
    compute = [e for e in events if e.action.kind in _COMPUTE]
    beside: dict[tuple[int, ActionKind], list[float]] = defaultdict(list)
    without: dict[tuple[int, ActionKind], list[float]] = defaultdict(list)
    for stage in {e.stage for e in compute}:
        others = _union([(o.start, o.end) for o in compute if o.stage != stage])
        starts = [start for start, _ in others]
        for e in compute:
            if e.stage != stage or e.duration <= 0:
                continue
            first = max(bisect.bisect_right(starts, e.start) - 1, 0)  # may reach into e
            shared = sum(max(0.0, min(e.end, end) - max(e.start, start))
                         for start, end in others[first:bisect.bisect_left(starts, e.end)])
            into = beside if shared > e.duration / 2 else without
            into[stage, e.action.kind].append(e.duration)
    result = []
    for kind in (ActionKind.F, ActionKind.B):
        both = [key for key in beside if key[1] is kind and key in without]
        if both:
            ratios = [statistics.median(beside[key]) / statistics.median(without[key])
                      for key in both]
            result.append(Interference(kind, statistics.geometric_mean(ratios),
                                       sum(len(beside[key]) for key in both),
                                       sum(len(without[key]) for key in both)))
    return result


@dataclasses.dataclass(frozen=True)
class LateMessages:
    """Messages delayed longer than the prediction says (message_delays: the send's own time
    and the receive's wait after it): time in handing them over that the prediction does not
    include (over torch.distributed the transport's: a send held up, or a receiver kept waiting
    after it; in one process the waiting stage thread's wake-up)."""

    late: int  # messages whose delay exceeded the predicted one by over the threshold
    receives: int  # receives found, with their sends, in both timelines
    excess: float  # seconds: the late messages' delays beyond the predicted ones, summed
    longest: float  # seconds: the largest of those
    worst: str  # the receive of the message most delayed beyond its prediction, e.g. "1RF0<0"
    threshold: float = LATE_AFTER


def late_messages(measured: Sequence[Event], predicted: Sequence[Event],
                  threshold: float = LATE_AFTER) -> LateMessages:
    """Compare each message's delay (message_delays) in a measured timeline with the same in
    the predicted one; the messages delayed over `threshold` seconds longer are late. An
    action that occurs more than once (runs appended to one trace) is paired by occurrence.
    Both timelines need one time axis for all stages: fxpipe's traces have one on one host,
    where every rank reads the same clock; across hosts, clock offsets enter the delays."""
    measured_delays, predicted_delays = message_delays(measured), message_delays(predicted)
    excess = sorted((delay - predicted_delays[key], str(key[0]))
                    for key, delay in measured_delays.items() if key in predicted_delays)
    late = [(seconds, name) for seconds, name in excess if seconds > threshold]
    longest, worst = late[-1] if late else (0.0, "")
    return LateMessages(len(late), len(excess), sum(s for s, _ in late), longest, worst,
                        threshold)


def message_delays(events: Sequence[Event]) -> dict[tuple[Action, int], float]:
    """Per receive, keyed by its action and how many times that action ran before it: its
    message's send's own time (a send the transport held up) plus the receive's wait after the
    send ended (receive_waits)."""
    sends = _by_occurrence(e for e in events if e.action.kind in _SEND)
    return {(action, k): wait + sends[action.partner, k].end - sends[action.partner, k].start
            for (action, k), wait in receive_waits(events).items()}


def receive_waits(events: Sequence[Event]) -> dict[tuple[Action, int], float]:
    """Per receive, keyed by its action and how many times that action ran before it: how long
    it ran on after the same occurrence of its message's send had ended."""
    by_occurrence = _by_occurrence(events)
    return {(action, k): e.end - max(e.start, by_occurrence[action.partner, k].end)
            for (action, k), e in by_occurrence.items()
            if action.kind in _RECV and (action.partner, k) in by_occurrence}


def _by_occurrence(events: Iterable[Event]) -> dict[tuple[Action, int], Event]:
    """Each event keyed by its action and how many times that action ran before it."""
    seen: Counter[Action] = Counter()
    keyed = {}
    for e in sorted(events, key=lambda e: e.start):
        keyed[e.action, seen[e.action]] = e
        seen[e.action] += 1
    return keyed


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The time covered by `spans`, as sorted disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def format_report(measured: StepTime, predicted: StepTime, schedule: str,
                  overhead: float = 0.0, slowdowns: Sequence[Interference] = (),
                  late: LateMessages | None = None, notes: Sequence[str] = (),
                  tail: Sequence[str] = (), recent: Sequence[float] = ()) -> str:
    """Predicted against measured, per stage and in total, and what bounds the pipeline;
    `overhead`: the runtime's own seconds per step outside the schedule, if measured;
    `slowdowns`: the measured timeline's `interference`; `late`: its `late_messages`;
    `notes`: lines shown right below the first (`unlike_prediction_lines`); `tail`: lines
    shown last (`shared_cores_lines`); `recent`: the measured step's makespan and those of the
    steps like it before it, told beside it where there are several (a single step moves with
    the machine's speed, their median less)."""
    def of_predicted(seconds: float) -> float:
        return seconds / predicted.makespan if predicted.makespan > 0 else float("nan")

    ratio = of_predicted(measured.makespan)
    if len(recent) > 1:
        middle = statistics.median(recent)
        ratio_of_middle = of_predicted(middle)
        notes = [f"the last {len(recent)} steps like it: {_ms(min(recent))} to "
                 f"{_ms(max(recent))} ms, median {_ms(middle)} ms (measured / predicted = "
                 f"{ratio_of_middle:.2f}); one step moves with the machine's speed, their "
                 f"median less", *notes]
    rows = []
    for m, p in zip(measured.stages, predicted.stages):
        rows.append([m.stage, f"{_ms(m.forward)} / {_ms(p.forward)}",
                     f"{_ms(m.backward)} / {_ms(p.backward)}",
                     f"{_ms(m.compute)} / {_ms(p.compute)}", _share(m.compute, measured),
                     _share(m.communication, measured), _share(m.reduction, measured),
                     _share(m.idle, measured)])
    header = ["stage", "fwd ms meas/pred", "bwd ms meas/pred", "compute ms meas/pred",
              "compute", "send/recv+wait", "all-reduce+step", "idle"]
    bound = measured.bounding_stage
    return "\n".join([
        f"step ({schedule}): measured {_ms(measured.makespan)} ms, predicted "
        f"{_ms(predicted.makespan)} ms (measured / predicted = {ratio:.2f})",
        *notes,
        format_table(header, rows),
        f"bubble: measured {measured.bubble:.0%}, predicted {predicted.bubble:.0%}; "
        f"sends and receives {measured.share('communication'):.0%} (with the waits for a "
        f"message, which a stage waiting for another's compute spends there too) and idle "
        f"{measured.share('idle'):.0%} of all stage time",
        f"bounding stage: {bound} (computes {_ms(measured.stages[bound].compute)} ms of the "
        f"{_ms(measured.makespan)} ms step)",
    ] + ([f"outside the schedule: the runtime's own work (splitting, starting the stages, "
          f"sharing sizes and the loss) adds a predicted {_ms(overhead)} ms to a step"]
         if overhead > 0 else []) + _interference_lines(slowdowns) + _late_lines(late)
        + list(tail))


def shared_cores_lines(stages: int, cores: int, ranks: bool = False,
                       capacity: ThreadCapacity | None = None, bound: bool = False,
                       threads: int | None = None) -> list[str]:
    """What to tell a user whose `stages` stages (stage threads of one process, or with
    `ranks` one per rank under torchrun) compute on a host's CPU of `cores` cores: nothing
    when each can have a core, else that they share them, and how the prediction takes that
    in: stage threads get an even split of the cores among the ones computing at once, or with
    `bound` (compile bound each to a core) of their own core among those bound to it (their
    units timed beside every other one, less the time they waited for a core); ranks run at
    the pace of the units timed on every rank at once. `capacity` (stage threads: compile's
    `thread_capacity`): how much of the units' work threads as many as its stages and as its
    cores got through at once, against one; where more threads got less done
    (`more_threads_lose`), the user learns that fewer stages per process are likely faster, and
    where as many as the stages got through less than one thread's work (not
    `shares_mostly_cores`), that the interpreter lock sets their pace, whose moves the
    prediction does not follow. `threads`: where fewer threads than the stages run them
    (Plan(stage_threads)), how many: each runs its stages' actions one at a time, and so does
    the prediction; on one thread, the prediction follows the lock's pace. Where the stage
    threads do not outnumber the cores, only the last: the interpreter lock."""
    if stages <= cores:
        if ranks or stages < 2 or capacity is None or capacity.shares_mostly_cores:
            return []
        return [_interpreter_lock_line(capacity, threads)]
    who = "ranks" if ranks else "stages"
    shared = not ranks and threads is not None and threads < stages
    many = f"{threads} threads" if shared and threads > 1 else "one thread"
    where = f"shared cores: {stages} {who} compute on this host's {cores} CPU " \
            f"core{'s' if cores > 1 else ''}"
    if ranks:
        lines = [f"{where}; the prediction runs every rank at the pace of the units timed on all "
                 f"the ranks at once, even where fewer compute; with at most {cores} CPU ranks "
                 "here each has one"]
    elif shared:
        lines = [f"{where}; they run on {many} (Plan(stage_threads)), "
                 f"{'each' if threads > 1 else 'which'} runs its stages' actions one at a time, "
                 f"as the prediction does, with the units timed beside {many} busy"
                 + (", and splits the cores evenly among the threads computing at once"
                    if threads > cores else "")]
    else:
        split = ("each stage thread is bound to a core, its neighbours to others, and the "
                 "prediction splits each core among the stages on it computing at once" if bound
                 else "the prediction splits the cores evenly among the stages computing at once")
        lines = [f"{where}; the units were timed with every stage thread busy, less the timing "
                 f"thread's waits for a core, and {split}; with at most {cores} CPU stages here "
                 "each has one"]
    if capacity is not None:
        line = (f"thread capacity: {capacity.stages} threads, each running all the model's "
                f"units, got through {capacity.at_stages:.2f}x the work of one thread at once, "
                f"{capacity.cores} thread{'s' if capacity.cores > 1 else ''} "
                f"{capacity.at_cores:.2f}x")
        if capacity.more_threads_lose:
            line += (": past the cores, more threads got less done here (they share the "
                     "cores, their caches and Python's interpreter lock), so ")
            line += (f"the stages run on {many} here (Plan(stage_threads))" if shared else
                     f"at most {capacity.cores} stage{'s' if capacity.cores > 1 else ''} per "
                     "process, or the stages spread over torchrun ranks with a core each, are "
                     "likely to step faster")
        lines.append(line)
        if not capacity.shares_mostly_cores:
            lines.append(_interpreter_lock_line(capacity, threads if shared else None))
    return lines


def _interpreter_lock_line(capacity: ThreadCapacity, threads: int | None) -> str:
    """What to tell a user whose stage threads got through less than one thread's work at once:
    the interpreter lock sets their pace, and on one thread (`threads`) the prediction follows
    it, on more it does not."""
    lock = (f"interpreter lock: {capacity.stages} threads got through {capacity.at_stages:.3f}x, "
            "under one thread's work at once, so Python's interpreter lock more than the cores "
            "sets their pace; ")
    if threads == 1:
        return lock + ("the stages run on one thread here (Plan(stage_threads)), whose pace "
                       "the units' timings alone hold")
    return lock + ("the units' timings hold the lock's cost beside busy threads, but not how it "
                   "moves with what the other stages run and where the OS puts the threads, so "
                   "steps may stray further from the prediction here")


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


def _late_lines(late: LateMessages | None) -> list[str]:
    if late is None or not late.late:
        return []
    return [f"late messages: {late.late} of {late.receives} were delayed over "
            f"{_ms(late.threshold)} ms longer than predicted in their sends and the receives' "
            f"waits after them ({_ms(late.excess)} ms in all, the longest "
            f"{_ms(late.longest)} ms: {late.worst}): time in handing messages over that the "
            "prediction does not include"]


def _interference_lines(slowdowns: Sequence[Interference]) -> list[str]:
    if not slowdowns:
        return []
    names = {ActionKind.F: "forwards", ActionKind.B: "backwards"}
    parts = [f"{names[i.kind]} {i.ratio:.2f}x ({i.beside} beside, {i.without} without)"
             for i in slowdowns]
    why = (". The stages share this machine's cores, and stage threads of one process share "
           "Python's interpreter lock" if any(i.ratio > 1 for i in slowdowns) else "")
    return [f"beside another stage's compute, actions took this many times as long as without "
            f"it: {'; '.join(parts)} (median per stage){why}"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _share(part: float, step: StepTime) -> str:
    return f"{part / step.makespan:.0%}" if step.makespan > 0 else "-"
