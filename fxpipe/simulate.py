"""The event simulator: start and end of every action of a schedule, and its ASCII timeline."""

from __future__ import annotations

import bisect
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
    after_wake_f: LinkCosts | None = None,
    after_wake_b: LinkCosts | None = None,
    after_post_f: LinkCosts = 0.0,
    after_post_b: LinkCosts = 0.0,
    cores: float | None = None,
    sharing: Iterable[int] | None = None,
    bound: Mapping[int, int] | None = None,
    workers: Iterable[Sequence[int]] | None = None,
    switch_f: Costs = 0.0,
    switch_b: Costs = 0.0,
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
    stage waited); a SEND whose receiver is blocked waiting for it adds after_wake_f /
    after_wake_b instead (by default the same; waking a process may cost its waker more).
    Likewise a message that was there before its RECV was posted landed while the receiver
    computed, whose CPU the transport's work to take it in shared: the stage's next compute
    takes after_receive_f / after_receive_b longer, within the same bound (0 by default; a
    message waited for landed while the stage waited). The runtime posts a RECV's receive
    early, right before the stage's first compute that comes before the RECV, and the
    transport's work on it goes on beside that compute, which takes after_post_f /
    after_post_b longer (0 by default), within the same bound, whether or not the stage
    waited before it (the time to post stays the RECV's).
    Stages that compute on one host's CPU share its cores: with `cores` given, the work of the
    `sharing` stages (every stage by default) goes at min(1, cores / k) of its pace while k of
    them work at once, everything but a RECV's wait and an ALLREDUCE counting as work
    (processor sharing; the given times are each stage's pace with a core of its own, as
    measured beside the others busy, less the waits for a core; None: each a core of its own,
    and `sharing` is not used). With `bound` as well, each sharing stage is bound to one of the
    whole `cores` (stage -> core, 0 .. cores - 1) and shares only that core, with the stages
    bound to it: its work goes at 1 / k of its pace while k of them work at once. With
    `workers`, each group of stages listed is run by one thread, an action at a time: when it
    is free it starts, of its stages in the group's order, the first whose next action need
    not wait (a RECV's message has arrived; a compute's F or B done), and otherwise waits for
    the first such message (a stage in no group has a thread of its own). A forward of stage s
    right after a backward on its thread (its own list's, or its group's) takes switch_f[s]
    longer, and a backward (or W) right after a forward switch_b[s] longer: the computes were
    timed each after its own kind (0 by default); a thread's first compute follows the last
    step's last, a backward. A compute-only schedule is lowered with
    `add_communication(schedule, edges)` first, so both forms time the same; a lowered one is
    checked with `check_communication`.

    forward[s][mb], backward[s][mb], weight[s][mb]: compute durations, given as a scalar, one
    per stage (N,), or per stage and micro-batch, (N, p) (repeated for every mini-batch) or
    (N, p * minibatches). step, allreduce: a scalar or one per stage.
    send_f, send_b: link times of an edge (src, dst), src < dst: activations src -> dst and their
    gradient dst -> src. A scalar (every edge), one per producing stage src (N,) like the cost
    model's CF_s / CB_s, or a mapping {(src, dst): time}. post_f, post_b: the sender's time per
    SEND of those messages, given the same ways; recv_post_f, recv_post_b: the receiver's time
    per RECV of them; after_send_f, after_send_b, after_wake_f, after_wake_b: the sender's
    compute after each SEND of them, after_receive_f, after_receive_b: the receiver's compute
    after each RECV of them that did not wait, and after_post_f, after_post_b: its compute
    that posts the receive, given the same ways. resume: a scalar or one per stage. cores: a
    number above 0, or None; sharing: stage indices (default: all); bound: a core for every
    sharing stage, or None; workers: groups of stage indices, each stage in one at most.
    switch_f, switch_b: a scalar or one per stage. edges: the stage pairs values cross, for a
    compute-only schedule (default: the chain).

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
    sharing = frozenset(range(n) if sharing is None else sharing)
    if cores is not None and not 0 < cores < math.inf:
        raise ValueError(f"cores={cores!r}: give the cores the sharing stages have between "
                         "them, a finite number above 0, or None for a core of their own each")
    if not sharing <= set(range(n)):
        raise ValueError(f"sharing={sorted(sharing)} names stages a schedule of {n} stages "
                         f"does not have; give stages among 0..{n - 1}")
    groups = _core_groups(cores, sharing, bound)
    worker_of = _worker_groups(workers, n)
    compute = {
        ActionKind.F: _per_micro_batch("forward", forward, n, p, k),
        ActionKind.B: _per_micro_batch("backward", backward, n, p, k),
        ActionKind.W: _per_micro_batch("weight", weight, n, p, k),
    }
    other = {ActionKind.STEP: _per_stage("step", step, n),
             ActionKind.ALLREDUCE: _per_stage("allreduce", allreduce, n)}
    link = _by_direction("send", send_f, send_b, n)
    post = _by_direction("post", post_f, post_b, n)
    receive = _by_direction("recv_post", post_f if recv_post_f is None else recv_post_f,
                            post_b if recv_post_b is None else recv_post_b, n)
    after = _by_direction("after_send", after_send_f, after_send_b, n)
    landing = _by_direction("after_receive", after_receive_f, after_receive_b, n)
    wake = _by_direction("after_wake", after_send_f if after_wake_f is None else after_wake_f,
                         after_send_b if after_wake_b is None else after_wake_b, n)
    after_post = _by_direction("after_post", after_post_f, after_post_b, n)
    durations = _Durations(compute, other, link, post, receive, after, landing, wake,
                           after_post, _per_stage("resume", resume, n),
                           {ActionKind.F: _per_stage("switch_f", switch_f, n),
                            ActionKind.B: _per_stage("switch_b", switch_b, n)})
    run = _Run(lowered, durations, groups, worker_of)
    run.run()
    stuck = run.stuck()
    if stuck:
        waits = "; ".join(f"stage {s} waits at {a} (action {run.pc[s]}) for {_needs(a)}"
                          for s, a in stuck)
        raise DeadlockError(f"schedule {schedule.name!r} deadlocks: {waits}, which never runs "
                            "before it. Reorder the lists so every dependency comes first")
    flat = [e for stage in run.events for e in stage]
    makespan = max((e.end for e in flat), default=0.0)
    return Timeline(lowered, flat, run.transfers, makespan, tuple(run.busy))


@dataclasses.dataclass(frozen=True)
class _Durations:
    """What each kind of action takes, as `simulate` was given it."""

    compute: dict[ActionKind, np.ndarray]
    other: dict[ActionKind, np.ndarray]
    link: dict[ActionKind, Callable[[int, int], float]]
    post: dict[ActionKind, Callable[[int, int], float]]
    receive: dict[ActionKind, Callable[[int, int], float]]
    after: dict[ActionKind, Callable[[int, int], float]]
    landing: dict[ActionKind, Callable[[int, int], float]]
    wake: dict[ActionKind, Callable[[int, int], float]]
    after_post: dict[ActionKind, Callable[[int, int], float]]
    resume: np.ndarray
    switch: dict[ActionKind, np.ndarray]  # F: a forward after a backward; B: the converse


@dataclasses.dataclass
class _Work:
    """A stage's CPU work in progress: when it ends at the current pace."""

    end: float
    cpu_bound: bool  # whether it takes a share of the cores (an all-reduce waits on its peers)


class _Run:
    """The event loop of `simulate`: time moves from one end of work or arrival to the next.

    A stage is in one of three states: running an action's CPU work (`work`), blocked in a
    RECV whose receive it posted (`posted`), or between actions for no time at all. CPU work
    of the stages of a group that share cores goes at min(1, cores / how many of them work)
    of its pace, and a change of pace moves the end of every such work still going on
    (processor sharing)."""

    def __init__(self, schedule: Schedule, durations: _Durations,
                 groups: Sequence[tuple[float, frozenset[int]]],
                 worker_of: Mapping[int, tuple[int, ...]]) -> None:
        n = schedule.stages
        self.schedule, self.durations = schedule, durations
        self.worker_of = worker_of  # a stage sharing a thread -> that thread's stages
        self.groups = groups  # (cores, the stages sharing them)
        self.group_of = {s: g for g, (_, stages) in enumerate(groups) for s in stages}
        self.paces = [1.0] * len(groups)
        self.pc = [0] * n
        self.waited = [True] * n  # whether the stage blocked since its last compute
        self.owed = [0.0] * n  # the slowdown of the SENDs and unwaited RECVs since it computed
        self.receives = [[i for i, a in enumerate(actions) if a.kind.is_recv]
                         for actions in schedule.actions]
        self.prefetched = [-1] * n  # the last RECV whose receive a compute posted
        # per thread (its stages), whether its last compute was a forward: a step follows
        # the last one's backwards
        self.forward_last: dict[tuple[int, ...], bool] = {}
        self.started = [0.0] * n  # when the stage's current action started
        self.busy = [0.0] * n
        self.finished: dict[Action, float] = {}  # computes, and messages keyed by their SEND
        self.link_free: dict[tuple[int, int], float] = {}
        self.work: dict[int, _Work] = {}
        self.posted: dict[int, float] = {}  # blocked stages: when they posted their receive
        self.events: list[list[Event]] = [[] for _ in range(n)]
        self.transfers: list[Event] = []
        self.now = 0.0

    def run(self) -> None:
        """Run every stage's list as far as it goes."""
        while True:
            self._settle()
            for g, pace in enumerate(self._paces()):
                if pace != self.paces[g]:  # what is left of the shared work goes at the new pace
                    for s, w in self.work.items():
                        if self._shares(s, w.cpu_bound) and self.group_of[s] == g:
                            w.end = self.now + (w.end - self.now) * self.paces[g] / pace
                    self.paces[g] = pace
            times = [w.end for w in self.work.values()] + [
                self.finished[m] for m in map(self._message, self.posted) if m in self.finished
            ] + self._awaited_by_idle_threads()
            if not times:
                return
            self.now = min(times)

    def stuck(self) -> list[tuple[int, Action]]:
        """The stages that never finished their list, and the action each stopped at."""
        return [(s, actions[self.pc[s]]) for s, actions in enumerate(self.schedule.actions)
                if self.pc[s] < len(actions)]

    def _settle(self) -> None:
        """Everything that happens at `now`: arrivals, work that ends, actions that start."""
        progress = True
        while progress:
            progress = False
            for s in [s for s in self.posted if self._arrived(s)]:
                self._landed(s)
                progress = True
            for s in [s for s, w in self.work.items() if w.end <= self.now]:
                self._end(s)
                progress = True
            for s in range(self.schedule.stages):
                progress |= self._begin(s)

    def _begin(self, s: int) -> bool:
        """Start stage s's next action, if it is between actions and may; whether it did."""
        actions, d = self.schedule.actions[s], self.durations
        if self.pc[s] == len(actions) or s in self.work or s in self.posted:
            return False
        if s in self.worker_of and self._next_on_thread(self.worker_of[s]) != s:
            return False
        a = actions[self.pc[s]]
        needs = _needs(a)
        if a.kind.is_compute and needs is not None and needs not in self.finished:
            return False  # a B before its F (a W before its B) on one list: a deadlock
        extra = 0.0  # a compute's slowdown from waiting, or from the messages beside it
        if a.kind.is_recv:  # posting the receive is the receiver's work, as sending is
            seconds = d.receive[a.partner.kind](a.peer, s)
        elif a.kind.is_compute:
            seconds = float(d.compute[a.kind][s, a.mb]) + self._switching(s, a.kind)
            posting = self._posting_beside(s)
            extra = (float(d.resume[s]) + min(posting, seconds) if self.waited[s]
                     else min(self.owed[s] + posting, seconds))
            self.waited[s], self.owed[s] = False, 0.0
        elif a.kind.is_send:
            seconds = d.post[a.kind](s, a.peer)
        else:
            seconds = float(d.other[a.kind][s])
        cpu_bound = a.kind is not ActionKind.ALLREDUCE
        pace = self.paces[self.group_of[s]] if self._shares(s, cpu_bound) else 1.0
        # added in this order, a compute ends at exactly the time a list scheduler gives it:
        # a message arriving then decides by a strict comparison whether its receiver waited
        self.work[s] = _Work(self.now + seconds / pace + extra / pace, cpu_bound)
        self.started[s] = self.now
        return True

    def _end(self, s: int) -> None:
        """Stage s's CPU work for its current action is done: a RECV now waits for its message."""
        a, d = self.schedule.actions[s][self.pc[s]], self.durations
        del self.work[s]
        if a.kind.is_recv:
            self.posted[s] = self.now
            return
        if a.kind.is_compute:
            self.finished[a] = self.now
            self.busy[s] += self.now - self.started[s]
        elif a.kind.is_send:
            wire = max(self.now, self.link_free.get((s, a.peer), 0.0))
            arrival = wire + d.link[a.kind](s, a.peer)
            # its receiver blocked in the RECV of it, and so woken by it (as _landed decides)
            waking = (a.peer in self.posted and self._message(a.peer) == a
                      and self.posted[a.peer] < arrival)
            self.owed[s] += (d.wake if waking else d.after)[a.kind](s, a.peer)
            self.link_free[s, a.peer] = self.finished[a] = arrival
            self.transfers.append(Event(s, a, wire, arrival))
        self._finish(s)

    def _landed(self, s: int) -> None:
        """Stage s's awaited message is there: its RECV ends."""
        message = self._message(s)
        # a strict comparison: a message there the moment its receive is posted did not wait
        # (so a tie, which rounding may decide, switches between resume and landing)
        if self.finished[message] > self.posted.pop(s):
            self.waited[s] = True
        else:  # it landed while the stage computed, whose CPU took it in
            self.owed[s] += self.durations.landing[message.kind](message.stage, s)
        self._finish(s)

    def _finish(self, s: int) -> None:
        """Stage s's current action ends now: record its event and go on to the next."""
        action = self.schedule.actions[s][self.pc[s]]
        self.events[s].append(Event(s, action, self.started[s], self.now))
        self.pc[s] += 1

    def _posting_beside(self, s: int) -> float:
        """after_post of the stage's next RECV, when its compute about to start is the first
        before that RECV (the runtime's driver posts the receive then), else 0."""
        receives = self.receives[s]
        following = bisect.bisect_right(receives, self.pc[s])
        if following == len(receives) or receives[following] <= self.prefetched[s]:
            return 0.0
        self.prefetched[s] = receives[following]
        receive = self.schedule.actions[s][receives[following]]
        return self.durations.after_post[receive.partner.kind](receive.peer, s)

    def _switching(self, s: int, kind: ActionKind) -> float:
        """How much longer stage s's compute of `kind` about to start takes for following
        the other kind on its thread (switch_f / switch_b), which then last ran `kind`."""
        thread, forward = self.worker_of.get(s, (s,)), kind is ActionKind.F
        switched = self.forward_last.get(thread, False) != forward
        self.forward_last[thread] = forward
        if not switched:
            return 0.0
        return float(self.durations.switch[ActionKind.F if forward else ActionKind.B][s])

    def _next_on_thread(self, stages: tuple[int, ...]) -> int | None:
        """The stage whose next action a thread running `stages` starts now: none while one
        of them runs an action or waits in a RECV; else the first that need not wait."""
        if any(t in self.work or t in self.posted for t in stages):
            return None
        return next((t for t in stages if self._may_go_on(t)), None)

    def _may_go_on(self, s: int) -> bool:
        """Whether stage s has a next action that would not wait: a RECV whose message has
        arrived, a compute whose F (W: B) is done, or any other action."""
        actions = self.schedule.actions[s]
        if self.pc[s] == len(actions):
            return False
        a = actions[self.pc[s]]
        if a.kind.is_recv:
            return self._arrived_for(a)
        needs = _needs(a)
        return not (a.kind.is_compute and needs is not None and needs not in self.finished)

    def _arrived_for(self, receive: Action) -> bool:
        return (receive.partner in self.finished
                and self.finished[receive.partner] <= self.now)

    def _awaited_by_idle_threads(self) -> list[float]:
        """When the messages still on their way to the next RECVs of stages on shared threads,
        none of them running an action or waiting in a RECV, arrive: a thread with nothing
        to do until then starts again at one of these times."""
        times = []
        for s in self.worker_of:
            actions = self.schedule.actions[s]
            if s in self.work or s in self.posted or self.pc[s] == len(actions):
                continue
            a = actions[self.pc[s]]
            if a.kind.is_recv and a.partner in self.finished:
                times.append(self.finished[a.partner])
        return [t for t in times if t > self.now]

    def _message(self, s: int) -> Action:
        """The SEND whose message stage s's current RECV takes."""
        return self.schedule.actions[s][self.pc[s]].partner

    def _arrived(self, s: int) -> bool:
        message = self._message(s)
        return message in self.finished and self.finished[message] <= self.now

    def _shares(self, s: int, cpu_bound: bool) -> bool:
        return cpu_bound and s in self.group_of

    def _paces(self) -> list[float]:
        """Each group's pace: min(1, its cores / how many of its stages work now)."""
        working = [0] * len(self.groups)
        for s, w in self.work.items():
            if self._shares(s, w.cpu_bound):
                working[self.group_of[s]] += 1
        return [min(1.0, cores / k) if k else 1.0
                for (cores, _), k in zip(self.groups, working)]


def _core_groups(cores: float | None, sharing: frozenset[int], bound: Mapping[int, int] | None
                 ) -> list[tuple[float, frozenset[int]]]:
    """The groups of stages that share cores, each with how many: none without `cores`, all
    `sharing` stages on `cores` together, or with `bound`, a core's stages on that core."""
    if cores is None:
        if bound is not None:
            raise ValueError("bound= places stages on cores: give cores= as well")
        return []
    if bound is None:
        return [(cores, sharing)]
    if cores != int(cores):
        raise ValueError(f"cores={cores!r} with bound=: stages are bound to whole cores; give "
                         "a whole number of cores")
    if set(bound) != sharing:
        raise ValueError(f"bound= places stages {sorted(bound)}, but the sharing stages are "
                         f"{sorted(sharing)}; bind every sharing stage, and only those")
    if not set(bound.values()) <= set(range(int(cores))):
        raise ValueError(f"bound={dict(bound)} names cores outside 0..{int(cores) - 1}; bind "
                         f"stages to cores among the {int(cores)} given")
    return [(1.0, frozenset(s for s in sharing if bound[s] == core))
            for core in sorted(set(bound.values()))]


def _worker_groups(workers: Iterable[Sequence[int]] | None, n: int
                   ) -> dict[int, tuple[int, ...]]:
    """Each stage that shares a thread with others -> that thread's stages, in order."""
    groups = [tuple(int(s) for s in group) for group in (workers or ())]
    listed = [s for group in groups for s in group]
    if len(set(listed)) != len(listed) or not set(listed) <= set(range(n)):
        raise ValueError(f"workers={groups}: give each of stages 0..{n - 1} in one group at "
                         "most")
    return {s: group for group in groups if len(group) > 1 for s in group}


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


def _by_direction(name: str, forward: LinkCosts, backward: LinkCosts, n: int
                  ) -> dict[ActionKind, Callable[[int, int], float]]:
    """A figure per message, looked up by the kind of its SEND: `name`_f for activations,
    `name`_b for their gradients."""
    return {ActionKind.SEND_F: _link(f"{name}_f", forward, n, forward=True),
            ActionKind.SEND_B: _link(f"{name}_b", backward, n, forward=False)}


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
