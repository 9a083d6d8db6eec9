"""The event simulator: start and end of every action of a schedule, and its ASCII timeline."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from fxpipe.ir import Event
from fxpipe.schedules import (
    Action,
    ActionKind,
    DeadlockError,
    Schedule,
    add_communication,
    check_communication,
)

__all__ = ["WEIGHT_SHARE", "Overheads", "Timeline", "simulate"]

Costs = float | Sequence[float] | np.ndarray
LinkCosts = float | Sequence[float] | np.ndarray | Mapping[tuple[int, int], float]
# where a schedule splits a backward into B and W and no W time is given, W's share of it
WEIGHT_SHARE = 0.5
# seconds each action of a kind takes on a stage beyond its compute or link time, keyed
# (stage, kind), or (stage, kind, peer) for a send or receive with that peer
Overheads = Mapping[tuple, float]


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
        """Idle fraction of the devices' compute: 1 - sum(busy) / (D * makespan), D devices
        (one per stage unless the schedule places several stages on a device)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.schedule.devices * self.makespan)

    @property
    def device_busy(self) -> tuple[float, ...]:
        """Per device, the time its stages spent in F, B and W."""
        totals = [0.0] * self.schedule.devices
        for s, seconds in enumerate(self.busy):
            totals[self.schedule.device(s)] += seconds
        return tuple(totals)

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
        """One row per stage, each action's label over the time it runs, '.' where idle; with
        several stages per device one row per device, labels led by the stage (`2F0`)."""
        placed = self.schedule.placement is not None
        stages = self.schedule.devices if placed else len(self.busy)
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
            label = f"{e.stage}{_label(e.action)}" if placed else _label(e.action)
            row = rows[self.schedule.device(e.stage)]
            for c in range(start, min(end, cols)):
                row[c] = label[c - start] if c - start < len(label) else " "
        s = self.schedule
        head = f"{s.name}: {s.stages} stages x {s.micro_batches} micro-batches" + (
            f" x {s.minibatches} mini-batches" if s.minibatches > 1 else "") + (
            f" on {s.devices} devices" if placed else "")
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
    weight: Costs | None = None,
    step: Costs = 0.0,
    allreduce: Costs = 0.0,
    edges: Iterable[tuple[int, int]] | None = None,
    overhead: Overheads | None = None,
) -> Timeline:
    """Time `schedule` and return every action's start and end.

    The model (ALGORITHMS §1, generalised from GPipe's closed form to any schedule): a stage
    runs its list one action at a time, in order, each as soon as the stage is free and the
    action's dependencies are met; with several stages per device (`Schedule.placement`) the
    device runs its program that way, so its stages' actions never overlap, and a message
    between two stages of one device is handed over at once, on no link. F(s, m) waits for the
    activations of every producer of stage s, B(s, m) for the gradients of every consumer and
    for F(s, m) on s (W(s, m) for B(s, m)).
    A SEND hands its message to the link from its stage to the peer, which carries one message
    at a time in send order; every directed device pair is a link of its own (full duplex). A
    RECV blocks its stage until the message has arrived. `overhead[(s, kind)]` (seconds, e.g.
    a calibration's) is added to every action of that kind on stage s: to a compute's time, to
    the stage's time in a SEND before its message leaves, and in a RECV before it waits; for a
    send or receive, `overhead[(s, kind, peer)]` takes the place of (s, kind) with that peer. A
    compute-only schedule is lowered with `add_communication(schedule, edges)` first, so both
    forms time the same; a lowered one is checked with `check_communication`.

    forward[s][mb], backward[s][mb], weight[s][mb]: compute durations, given as a scalar, one
    per stage (N,), or per stage and micro-batch, (N, p) (repeated for every mini-batch) or
    (N, p * minibatches). step, allreduce: a scalar or one per stage. `weight` is W's time, B
    then being the input gradient's alone where a stage's list splits that micro-batch's
    backward, and B + W where it does not (a whole backward, as some of DualPipeV's); with
    weight=None, `backward` is the whole backward,
    and where a stage's list splits a micro-batch's backward into B and W each takes half
    of it (`WEIGHT_SHARE`: a linear layer's input and weight gradients are matrix products
    of one size, dX = dY W^T and dW = dY^T X).
    send_f, send_b: link times of an edge (src, dst), src < dst: activations src -> dst and their
    gradient dst -> src. A scalar (every edge), one per producing stage src (N,) like the cost
    model's CF_s / CB_s, or a mapping {(src, dst): time}. edges: the stage pairs values cross,
    for a compute-only schedule (default: the chain).

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
    }
    if weight is None:  # the backward split where the lists split it
        compute[ActionKind.W] = compute[ActionKind.B] * WEIGHT_SHARE
        compute[ActionKind.B] = compute[ActionKind.B].copy()
        for s, actions in enumerate(lowered.actions):
            split = sorted({a.mb for a in actions if a.kind is ActionKind.W})
            compute[ActionKind.B][s, split] *= 1.0 - WEIGHT_SHARE
    else:
        compute[ActionKind.W] = _per_micro_batch("weight", weight, n, p, k)
        whole = np.ones_like(compute[ActionKind.B], dtype=bool)  # B runs W's work too
        for s, actions in enumerate(lowered.actions):
            whole[s, sorted({a.mb for a in actions if a.kind is ActionKind.W})] = False
        compute[ActionKind.B] = np.where(whole, compute[ActionKind.B] + compute[ActionKind.W],
                                         compute[ActionKind.B])
    other = {ActionKind.STEP: _per_stage("step", step, n),
             ActionKind.ALLREDUCE: _per_stage("allreduce", allreduce, n)}
    link = {ActionKind.SEND_F: _link("send_f", send_f, n, forward=True),  # by SEND kind
            ActionKind.SEND_B: _link("send_b", send_b, n, forward=False)}
    extra = _overheads(overhead or {}, n)

    def own_time(a: Action) -> float:
        """The stage's own time in `a` (a RECV's before its wait, a SEND's before the wire)."""
        seconds = extra.get((a.stage, a.kind, a.peer), extra.get((a.stage, a.kind), 0.0))
        if a.kind.is_compute:
            seconds += float(compute[a.kind][a.stage, a.mb])
        elif a.kind in other:
            seconds += float(other[a.kind][a.stage])
        return max(seconds, 0.0)

    programs, where = lowered.device_programs, lowered.device
    pc, free, busy = [0] * len(programs), [0.0] * len(programs), [0.0] * n
    finished: dict[Action, float] = {}  # computes, and messages (keyed by their SEND) arrived
    link_free: dict[tuple[int, int], float] = {}  # by directed device pair
    events: list[list[Event]] = [[] for _ in range(n)]
    transfers: list[Event] = []
    progress = True
    while progress:  # each pass runs every device as far as its dependencies allow
        progress = False
        for d, actions in enumerate(programs):
            while pc[d] < len(actions):
                a = actions[pc[d]]
                s = a.stage
                needs = _needs(a)
                if needs is not None and needs not in finished:
                    break
                start = free[d]
                end = start + own_time(a)
                if a.kind.is_recv:
                    end = max(end, finished[a.partner])
                elif a.kind.is_send and where(a.peer) == d:  # a hand-off within the device
                    finished[a] = end
                    transfers.append(Event(s, a, end, end))
                elif a.kind.is_send:
                    wire = max(end, link_free.get((d, where(a.peer)), 0.0))
                    arrival = wire + link[a.kind](s, a.peer)
                    link_free[d, where(a.peer)] = finished[a] = arrival
                    transfers.append(Event(s, a, wire, arrival))
                elif a.kind.is_compute:
                    finished[a] = end
                    busy[s] += end - start
                events[s].append(Event(s, a, start, end))
                free[d] = end
                pc[d] += 1
                progress = True
    unit = "stage" if lowered.placement is None else "device"
    stuck = [(d, actions[pc[d]]) for d, actions in enumerate(programs) if pc[d] < len(actions)]
    if stuck:
        waits = "; ".join(f"{unit} {d} waits at {a} (action {pc[d]}) for {_needs(a)}"
                          for d, a in stuck)
        raise DeadlockError(f"schedule {schedule.name!r} deadlocks: {waits}, which never runs "
                            "before it. Reorder the lists so every dependency comes first")
    flat = [e for stage in events for e in stage]
    makespan = max((e.end for e in flat), default=0.0)
    return Timeline(lowered, flat, transfers, makespan, tuple(busy))


def _overheads(overhead: Overheads, n: int) -> dict[tuple, float]:
    """The overhead table checked: stages (and peers) in range, finite seconds."""
    table = {}
    for key, seconds in overhead.items():
        stage, kind, *peer = key
        known = 0 <= stage < n and isinstance(kind, ActionKind) and len(peer) <= 1
        if known and peer:  # a peer only for a send or receive, and one of the stages
            known = (kind.is_send or kind.is_recv) and 0 <= peer[0] < n
        if not known:
            raise ValueError(f"overhead has an entry for {key!r}; give (stage in 0..{n - 1}, "
                             "ActionKind) keys, or (stage, kind, peer) for a send or receive")
        if not math.isfinite(seconds):
            raise ValueError(f"overhead[({stage}, {kind.name}{', ' if peer else ''}"
                             f"{', '.join(map(str, peer))})] must be finite seconds, got "
                             f"{seconds!r}")
        table[key] = float(seconds)
    return table


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
