"""The event simulator: start and end of every action of a schedule, and its ASCII timeline."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from fxpipe.schedules import (
    Action,
    ActionKind,
    DeadlockError,
    Schedule,
    add_communication,
    check_communication,
)

__all__ = ["Event", "Timeline", "simulate"]

Costs = float | Sequence[float] | np.ndarray
LinkCosts = float | Sequence[float] | np.ndarray | Mapping[tuple[int, int], float]


@dataclasses.dataclass(frozen=True)
class Event:
    """When `action` ran on `stage` (for a link transfer: when its message was on the wire)."""

    stage: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Timeline:
    """The simulated run of a (lowered) schedule."""

    schedule: Schedule
    events: list[Event]  # every action of every stage, in start order per stage
    transfers: list[Event]  # one per SEND: the message on its link, stage = the sender
    makespan: float
    busy: tuple[float, ...]  # per stage, time spent in F, B and W

    @property
    def bubble(self) -> float:
        """Idle fraction of the stages' compute: 1 - sum(busy) / (N * makespan)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    def event(self, action: Action) -> Event:
        """The event of `action`."""
        try:
            return self._by_action[action]
        except KeyError:
            raise ValueError(f"{action} is not in schedule {self.schedule.name!r}") from None

    @functools.cached_property
    def _by_action(self) -> dict[Action, Event]:
        return {e.action: e for e in self.events}

    def ascii(self, width: int = 80) -> str:
        """One row per stage, each action's label over the time it runs, '.' where idle."""
        stages = len(self.busy)
        prefix = len(str(stages - 1)) + 2
        cols = width - prefix - 1
        if cols < 1:
            raise ValueError(f"width={width} leaves no room for the timeline; use at least "
                             f"{prefix + 2}")
        shown = [e for e in self.events  # a receive's wait is idle time
                 if e.duration > 0 and not (e.action.kind.is_send or e.action.kind.is_recv)]
        scale = _scale(self.makespan, min((e.duration for e in shown), default=0.0), cols)
        cols = min(cols, math.ceil(self.makespan * scale - 1e-9))
        rows = [["."] * cols for _ in range(stages)]
        for e in shown:
            start, end = round(e.start * scale), round(e.end * scale)
            label = _label(e.action)
            for c in range(start, min(end, cols)):
                rows[e.stage][c] = label[c - start] if c - start < len(label) else " "
        s = self.schedule
        head = f"{s.name}: {s.stages} stages x {s.micro_batches} micro-batches" + (
            f" x {s.minibatches} mini-batches" if s.minibatches > 1 else "")
        lines = [head, *(f"{i:>{prefix - 2}} |{''.join(r)}|" for i, r in enumerate(rows))]
        lines.append(f"step time {self.makespan:.6g}, bubble {self.bubble:.1%}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.ascii()


def _scale(makespan: float, shortest: float, cols: int) -> float:
    """Columns per unit of time: a whole number (>= 2) of columns for the shortest action when
    the timeline fits that way, so actions whose times are multiples of it line up."""
    if makespan <= 0:
        return 0.0
    per_shortest = math.floor(cols * shortest / makespan)
    return per_shortest / shortest if per_shortest >= 2 else cols / makespan


def _label(action: Action) -> str:
    if action.kind is ActionKind.STEP:
        return "S"
    if action.kind is ActionKind.ALLREDUCE:
        return "A"
    return f"{action.kind.value}{action.mb}"


def simulate(
    schedule: Schedule,
    forward: Costs,
    backward: Costs,
    send_f: LinkCosts = 0.0,
    send_b: LinkCosts = 0.0,
    *,
    weight: Costs = 0.0,
    step: Costs = 0.0,
    allreduce: Costs = 0.0,
    edges: Iterable[tuple[int, int]] | None = None,
    post_f: LinkCosts = 0.0,
    post_b: LinkCosts = 0.0,
    resume: Costs = 0.0,
    recv_post_f: LinkCosts | None = None,
    recv_post_b: LinkCosts | None = None,
    after_send_f: LinkCosts = 0.0,
    after_send_b: LinkCosts = 0.0,
    after_receive_f: LinkCosts = 0.0,
    after_receive_b: LinkCosts = 0.0,
) -> Timeline:
    """Time `schedule` and return every action's start and end.

    The model (ALGORITHMS §1, generalised from GPipe's closed form to any schedule): a stage
    runs its list one action at a time, in order, each as soon as the stage is free and the
    action's dependencies are met. F(s, m) waits for the activations of every producer of stage
    s, B(s, m) for the gradients of every consumer and for F(s, m) on s (W(s, m) for B(s, m)).
    A SEND takes its stage the time to post its message (post_f / post_b: a transport's
    per-tensor work; 0 by default) and then hands the message to the link from the stage to
    its peer, which carries one message at a time in send order; every directed stage pair is
    a link of its own, so a forward and a backward transfer between two stages never block
    each other (full duplex). A RECV takes its stage the time to post the receive (recv_post_f
    / recv_post_b; by default the sender's), then blocks it until the message has arrived. A
    stage's compute right after it blocked (its first, as the step starts with every stage
    waiting to agree on the micro-batch sizes, and the first after a RECV whose message was
    not there yet) takes `resume[s]` longer: a process woken from a wait runs slower for a
    while (0 by default). Otherwise a stage's compute after SENDs takes the sum of their
    after_send_f / after_send_b longer, at most twice its own time: the transport's work on a
    message goes on beside the sender's next compute, sharing its CPU, so it takes at most
    half of it (0 by default; after a wait resume alone counts, as that work ran while the
    stage waited). Likewise a message that was there before its RECV was posted landed while
    the receiver computed, whose CPU the transport's work to take it in shared: the stage's
    next compute takes after_receive_f / after_receive_b longer, within the same bound (0 by
    default; a message waited for landed while the stage waited). A compute-only schedule is
    lowered with `add_communication(schedule, edges)` first, so both forms time the same; a
    lowered one is checked with `check_communication`.

    forward[s][mb], backward[s][mb], weight[s][mb]: compute durations, given as a scalar, one
    per stage (N,), or per stage and micro-batch, (N, p) (repeated for every mini-batch) or
    (N, p * minibatches). step, allreduce: a scalar or one per stage.
    send_f, send_b: link times of an edge (src, dst), src < dst: activations src -> dst and their
    gradient dst -> src. A scalar (every edge), one per producing stage src (N,) like the cost
    model's CF_s / CB_s, or a mapping {(src, dst): time}. post_f, post_b: the sender's time per
    SEND of those messages, given the same ways; recv_post_f, recv_post_b: the receiver's time
    per RECV of them; after_send_f, after_send_b: the sender's compute after each SEND of
    them, and after_receive_f, after_receive_b: the receiver's compute after each RECV of
    them that did not wait, given the same ways. resume: a scalar or one per stage.
    edges: the stage pairs values cross, for a compute-only schedule (default: the chain).

    Raises DeadlockError when the lists wait on each other forever, ScheduleError when the
    sends and receives of a lowered schedule do not match.
    """
    if schedule.lowered:
        if edges is not None:
            raise ValueError(f"schedule {schedule.name!r} already has SEND/RECV actions, which "
                             "fix its edges; pass edges only with a compute-only schedule")
        lowered = schedule
    else:
        lowered = add_communication(schedule, edges)
    check_communication(lowered)
    n, p, k = lowered.stages, lowered.micro_batches, lowered.minibatches
    compute = {
        ActionKind.F: _per_micro_batch("forward", forward, n, p, k),
        ActionKind.B: _per_micro_batch("backward", backward, n, p, k),
        ActionKind.W: _per_micro_batch("weight", weight, n, p, k),
    }
    other = {ActionKind.STEP: _per_stage("step", step, n),
             ActionKind.ALLREDUCE: _per_stage("allreduce", allreduce, n)}
    link = {ActionKind.SEND_F: _link("send_f", send_f, n, forward=True),
            ActionKind.SEND_B: _link("send_b", send_b, n, forward=False)}
    post = {ActionKind.SEND_F: _link("post_f", post_f, n, forward=True),
            ActionKind.SEND_B: _link("post_b", post_b, n, forward=False)}
    receive = {ActionKind.SEND_F: _link("recv_post_f", post_f if recv_post_f is None
                                        else recv_post_f, n, forward=True),
               ActionKind.SEND_B: _link("recv_post_b", post_b if recv_post_b is None
                                        else recv_post_b, n, forward=False)}
    after = {ActionKind.SEND_F: _link("after_send_f", after_send_f, n, forward=True),
             ActionKind.SEND_B: _link("after_send_b", after_send_b, n, forward=False)}
    landing = {ActionKind.SEND_F: _link("after_receive_f", after_receive_f, n, forward=True),
               ActionKind.SEND_B: _link("after_receive_b", after_receive_b, n, forward=False)}
    return _run(lowered, compute, other, link, post, receive, after, landing,
                _per_stage("resume", resume, n))


def _run(
    schedule: Schedule,
    compute: dict[ActionKind, np.ndarray],
    other: dict[ActionKind, np.ndarray],
    link: dict[ActionKind, Callable[[int, int], float]],
    post: dict[ActionKind, Callable[[int, int], float]],
    receive: dict[ActionKind, Callable[[int, int], float]],
    after: dict[ActionKind, Callable[[int, int], float]],
    landing: dict[ActionKind, Callable[[int, int], float]],
    resume: np.ndarray,
) -> Timeline:
    n = schedule.stages
    pc, free, busy = [0] * n, [0.0] * n, [0.0] * n
    waited = [True] * n  # whether the stage blocked since its last compute
    owed = [0.0] * n  # the slowdown of the SENDs and unwaited RECVs since its last compute
    finished: dict[Action, float] = {}  # compute actions and messages (keyed by their SEND)
    link_free: dict[tuple[int, int], float] = {}
    events: list[list[Event]] = [[] for _ in range(n)]
    transfers: list[Event] = []
    progress = True
    while progress:
        progress = False
        for s, stage in enumerate(schedule.actions):
            while pc[s] < len(stage):
                a = stage[pc[s]]
                needs = _needs(a)
                if needs is not None and needs not in finished:
                    break
                start = free[s]
                if a.kind.is_recv:  # posting the receive is the receiver's work, as sending is
                    posted = start + receive[needs.kind](a.peer, s)
                    end = max(posted, finished[needs])
                    if finished[needs] > posted:
                        waited[s] = True
                    else:  # it landed while the stage computed
                        owed[s] += landing[needs.kind](a.peer, s)
                elif a.kind.is_compute:
                    work = float(compute[a.kind][s, a.mb])
                    end = start + work + (float(resume[s]) if waited[s] else min(owed[s], work))
                    waited[s], owed[s] = False, 0.0
                    busy[s] += end - start
                elif a.kind.is_send:
                    end = start + post[a.kind](s, a.peer)
                    owed[s] += after[a.kind](s, a.peer)
                    wire = max(end, link_free.get((s, a.peer), 0.0))
                    arrival = wire + link[a.kind](s, a.peer)
                    link_free[s, a.peer] = finished[a] = arrival
                    transfers.append(Event(s, a, wire, arrival))
                else:
                    end = start + float(other[a.kind][s])
                if a.kind.is_compute:
                    finished[a] = end
                free[s] = end
                events[s].append(Event(s, a, start, end))
                pc[s] += 1
                progress = True
    stuck = [(s, stage[pc[s]]) for s, stage in enumerate(schedule.actions) if pc[s] < len(stage)]
    if stuck:
        waits = "; ".join(f"stage {s} waits at {a} (action {pc[s]}) for {_needs(a)}"
                          for s, a in stuck)
        raise DeadlockError(f"schedule {schedule.name!r} deadlocks: {waits}, which never runs "
                            "before it. Reorder the lists so every dependency comes first")
    flat = [e for stage in events for e in stage]
    makespan = max((e.end for e in flat), default=0.0)
    return Timeline(schedule, flat, transfers, makespan, tuple(busy))


def _needs(a: Action) -> Action | None:
    """The action that must have finished before `a` can start, beyond its list order."""
    if a.kind.is_recv:
        return a.partner
    if a.kind is ActionKind.B:
        return Action(a.stage, ActionKind.F, a.mb)
    if a.kind is ActionKind.W:
        return Action(a.stage, ActionKind.B, a.mb)
    return None


def _per_micro_batch(name: str, value: Costs, n: int, p: int, k: int) -> np.ndarray:
    """Durations as an (N, p * k) array, from a scalar, (N,), (N, p) or (N, p * k)."""
    array = _times(name, value)
    if array.ndim == 0:
        return np.full((n, p * k), float(array))
    if array.ndim == 1 and array.shape == (n,):
        return np.repeat(array[:, None], p * k, axis=1)
    if array.ndim == 2 and array.shape == (n, p * k):
        return array
    if array.ndim == 2 and array.shape == (n, p):
        return np.tile(array, (1, k))
    shapes = f"({n},), ({n}, {p})" + (f" or ({n}, {p * k})" if k > 1 else "")
    raise ValueError(f"{name} has shape {array.shape}; give a scalar, {shapes} "
                     "(stages x micro-batches)")


def _per_stage(name: str, value: Costs, n: int) -> np.ndarray:
    array = _times(name, value)
    if array.ndim == 0:
        return np.full(n, float(array))
    if array.shape != (n,):
        raise ValueError(f"{name} has shape {array.shape}; give a scalar or one time per stage "
                         f"({n},)")
    return array


def _times(name: str, value: object) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be numbers (seconds), not {value!r}") from e
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{name} must hold finite non-negative times, got {value!r}")
    return array


def _link(name: str, value: LinkCosts, n: int, forward: bool) -> Callable[[int, int], float]:
    """time(sender, receiver) of a message, looked up by its edge (src, dst), src < dst."""
    if isinstance(value, Mapping):
        costs = {tuple(edge): float(_times(name, t)) for edge, t in value.items()}

        def lookup(src: int, dst: int) -> float:
            if (src, dst) not in costs:
                raise ValueError(f"{name} has no time for edge ({src}, {dst}); add it to the "
                                 "mapping or pass a scalar")
            return costs[src, dst]
    else:
        times = _per_stage(name, value, n)

        def lookup(src: int, dst: int) -> float:
            return float(times[src])

    if forward:
        return lookup
    return lambda sender, receiver: lookup(receiver, sender)
