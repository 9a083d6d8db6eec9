"""Lowering a schedule for a runtime: sends and receives, steps, and the check it cannot hang."""

from __future__ import annotations

import bisect
import operator
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence

from fxpipe.schedules.actions import (
    _MINIBATCH_KINDS,
    _PARTNER,
    _SERVES,
    Action,
    ActionKind,
    B,
    DeadlockError,
    F,
    Schedule,
    ScheduleError,
)
from fxpipe.schedules.generators import build

__all__ = ["Message", "add_communication", "add_step", "chain", "check_communication",
           "delivered_sends", "gradients_let_go", "lower", "message_of"]


def chain(stages: int) -> tuple[tuple[int, int], ...]:
    """The edges of a plain chain of stages: (0, 1), (1, 2), ..."""
    return tuple((s, s + 1) for s in range(stages - 1))


def add_communication(
    schedule: Schedule, edges: Iterable[tuple[int, int]] | None = None
) -> Schedule:
    """Insert the sends and receives the stage edges (src, dst) call for; default: `chain`.

    Before F(m) a stage receives from each producer, after it sends to each consumer; before B(m)
    it receives the gradient from each consumer, after it sends one back to each producer. Several
    values crossing one (src, dst) pair travel as one message per micro-batch; skip edges
    (dst > src + 1) get their own messages.
    """
    if schedule.lowered:
        raise ValueError(f"schedule {schedule.name!r} already has SEND/RECV actions; "
                         "add_communication takes a compute-only schedule")
    edges = chain(schedule.stages) if edges is None else _check_edges(edges, schedule.stages)
    producers, consumers = defaultdict(list), defaultdict(list)
    for src, dst in sorted(edges):
        producers[dst].append(src)
        consumers[src].append(dst)
    lists = []
    for s, stage in enumerate(schedule.actions):
        lowered = []
        for a in stage:
            if a.kind is F:
                lowered += [Action(s, ActionKind.RECV_F, a.mb, src) for src in producers[s]]
                lowered += [a, *(Action(s, ActionKind.SEND_F, a.mb, d) for d in consumers[s])]
            elif a.kind is B:
                lowered += [Action(s, ActionKind.RECV_B, a.mb, d) for d in consumers[s]]
                lowered += [a, *(Action(s, ActionKind.SEND_B, a.mb, src) for src in producers[s])]
            else:
                lowered.append(a)
        lists.append(lowered)
    return schedule._replace(lists)


def _check_edges(edges: Iterable[tuple[int, int]], stages: int) -> set[tuple[int, int]]:
    checked = set()
    for edge in edges:
        try:
            src, dst = (operator.index(x) for x in edge)
        except (TypeError, ValueError):
            raise ValueError(f"edge {edge!r} is not a (src, dst) pair of stage indices") from None
        if not 0 <= src < dst < stages:
            raise ValueError(f"edge ({src}, {dst}) must satisfy 0 <= src < dst < {stages}: "
                             "values flow from a stage to a later one")
        checked.add((src, dst))
    return checked


def add_step(schedule: Schedule, allreduce: bool = False, step: bool = True) -> Schedule:
    """Close every mini-batch on every stage with a STEP (after the stage's last action of that
    mini-batch), preceded by an ALLREDUCE when `allreduce`; with `step=False` the ALLREDUCE
    alone (the optimizer step is the caller's). Mini-batches already closed stay."""
    kinds = [ActionKind.ALLREDUCE] * allreduce + [ActionKind.STEP] * step
    lists = []
    for s, stage in enumerate(schedule.actions):
        have = {(a.kind, schedule.minibatch(a)) for a in stage if a.kind in _MINIBATCH_KINDS}
        last = {schedule.minibatch(a): i for i, a in enumerate(stage)
                if a.kind not in _MINIBATCH_KINDS}
        after = defaultdict(list)
        for k, i in last.items():
            mb = None if schedule.minibatches == 1 else k
            after[i] += [Action(s, kind, mb) for kind in kinds if (kind, k) not in have]
        lists.append([x for i, a in enumerate(stage) for x in (a, *after[i])])
    return schedule._replace(lists)


# --- checking ---------------------------------------------------------------------------------


def check_communication(schedule: Schedule) -> None:
    """Raise ScheduleError unless every send meets one receive in the same order, each one sits
    on the right side of the compute it serves, every F/B talks to the same peers, and the lists
    cannot hang; DeadlockError when they can.

    The model a runtime must follow: a SEND is posted and the stage moves on (isend, completed
    later); a RECV blocks until its message arrives; messages on each directed stage pair are
    matched first-in first-out. With several stages per device, each device runs its program
    (`Schedule.device_programs`) in order and blocks at its current receive; a message between
    two stages of one device is a local hand-off under the same rules.
    """
    present = [set(stage) for stage in schedule.actions]
    for s, stage in enumerate(schedule.actions):
        where = {a: i for i, a in enumerate(stage)}
        for a in stage:
            if a.kind not in _PARTNER:
                continue
            partner = a.partner
            if partner not in present[a.peer]:
                raise ScheduleError(f"{a} on stage {s} has no matching {partner} on stage "
                                    f"{a.peer}; add it there or drop {a}")
            compute = Action(s, _SERVES[a.kind], a.mb)
            before = a.kind.is_recv
            if compute not in where or (where[a] < where[compute]) != before:
                side = "before" if before else "after"
                raise ScheduleError(f"{a} must come {side} {compute} on stage {s}")
    _check_peers(schedule)
    _run_messages(schedule)


def _check_peers(schedule: Schedule) -> None:
    """Every F (B) of a stage talks to the same peers, and gradients retrace activations."""
    for s, stage in enumerate(schedule.actions):
        ran = {kind: {a.mb for a in stage if a.kind is kind} for kind in (F, B)}
        peers = defaultdict(lambda: defaultdict(set))
        for a in stage:
            if a.kind in _PARTNER:
                peers[a.kind][a.peer].add(a.mb)
        for kind, by_peer in peers.items():
            for peer, mbs in by_peer.items():
                missing = ran[_SERVES[kind]] - mbs
                if missing:
                    raise ScheduleError(
                        f"stage {s} has {kind.name} with stage {peer} but not for micro-batches "
                        f"{sorted(missing)}; every {_SERVES[kind].name} must talk to the same "
                        "peers")
        mirrored = ((ActionKind.RECV_F, ActionKind.SEND_B), (ActionKind.SEND_F, ActionKind.RECV_B))
        for a, b in mirrored:
            if ran[B] and set(peers[a]) != set(peers[b]):
                raise ScheduleError(
                    f"stage {s} has {a.name} with stages {sorted(peers[a])} but {b.name} with "
                    f"{sorted(peers[b])}; gradients go back along the edges activations came by")


def _run_messages(schedule: Schedule) -> None:
    """Run the device programs with messages as the only constraint: a device blocks on its
    program's current receive until the message is in its channel."""
    channels: dict[tuple[int, int], deque[Action]] = defaultdict(deque)
    programs = schedule.device_programs
    pc = [0] * len(programs)
    progress = True
    while progress:
        progress = False
        for d, program in enumerate(programs):
            while pc[d] < len(program):
                a = program[pc[d]]
                s = a.stage
                if a.kind.is_send:
                    channels[s, a.peer].append(a)
                elif a.kind.is_recv:
                    queue = channels[a.peer, s]
                    if not queue:
                        break
                    expected = a.partner
                    if queue[0] != expected:
                        raise ScheduleError(
                            f"messages from stage {a.peer} to stage {s} arrive in another order "
                            f"than received: {a} expects {expected}, but {queue[0]} comes first; "
                            "order the receives like the sends")
                    queue.popleft()
                pc[d] += 1
                progress = True
    unit = "stage" if schedule.placement is None else "device"
    waiting = [(d, program[pc[d]]) for d, program in enumerate(programs) if pc[d] < len(program)]
    if waiting:
        waits = "; ".join(f"{unit} {d} waits at {a} (action {pc[d]}) for {a.partner}"
                          for d, a in waiting)
        explained = (_explain_deadlock(schedule, pc) if schedule.placement is None else
                     "Reorder the lists so every receive is met by a send its peer reaches first")
        raise DeadlockError(f"schedule {schedule.name!r} deadlocks: {waits}. {explained}")


Message = tuple[int, int, str, int]  # (sending stage, receiving stage, "F" or "B", micro-batch)


def message_of(a: Action) -> Message:
    """The message a send or receive action moves."""
    direction = "F" if a.kind in (ActionKind.SEND_F, ActionKind.RECV_F) else "B"
    return (a.stage, a.peer, direction, a.mb) if a.kind.is_send else (a.peer, a.stage,
                                                                       direction, a.mb)


def delivered_sends(programs: Sequence[Sequence[Action]]) -> list[dict[int, list[Message]]]:
    """Per device program, position -> the messages that device sent to another device which
    are surely received once its action at that position is done: their receive happens before
    it (that device heard, directly or relayed, from the receiver after it). A runtime may
    complete such sends there without waiting on the receiver. Found with vector clocks over
    the programs run with messages as the only constraint (as `check_communication`); a
    send never found received is not listed."""
    device_of = {a.stage: d for d, program in enumerate(programs) for a in program}
    clocks = [[0] * len(programs) for _ in programs]
    after: list[list[list[int]]] = [[] for _ in programs]  # each device's clock per action
    sent: dict[Message, list[int]] = {}  # the sender's clock at the send
    received: dict[Message, int] = {}  # the receiver's own count at the receive
    pc = [0] * len(programs)
    progress = True
    while progress:
        progress = False
        for d, program in enumerate(programs):
            clock = clocks[d]
            while pc[d] < len(program):
                a = program[pc[d]]
                if a.kind.is_recv:
                    if message_of(a) not in sent:
                        break
                    clock[:] = map(max, clock, sent[message_of(a)])
                clock[d] += 1
                if a.kind.is_send:
                    sent[message_of(a)] = list(clock)
                elif a.kind.is_recv:
                    received[message_of(a)] = clock[d]
                after[d].append(list(clock))
                pc[d] += 1
                progress = True
    found: list[dict[int, list[Message]]] = [{} for _ in programs]
    for d, program in enumerate(programs):
        heard: dict[int, list[int]] = {}  # per peer device, its count d knew of; never falls
        for i, a in enumerate(program):
            peer = device_of.get(a.peer) if a.kind.is_send else None
            if peer is None or peer == d or message_of(a) not in received:
                continue
            if peer not in heard:
                heard[peer] = [clock[peer] for clock in after[d]]
            at = bisect.bisect_left(heard[peer], received[message_of(a)], lo=i)
            if at < len(heard[peer]):
                found[d].setdefault(at, []).append(message_of(a))
    return found


def gradients_let_go(schedule: Schedule) -> dict[int, dict[int, int]]:
    """Per stage, per micro-batch whose input gradient it sends back to an earlier stage on
    another device: the index, among the stage's own compute actions, of the first one that
    runs once its transport knows the message received (`delivered_sends`, on the schedule
    with its chain's messages); a gradient never known so (completed at the step's flush) is
    absent."""
    lowered = schedule if schedule.lowered else add_communication(schedule)
    programs = lowered.device_programs
    let_go: dict[int, dict[int, int]] = defaultdict(dict)
    for program, released in zip(programs, delivered_sends(programs)):
        ran: dict[int, int] = defaultdict(int)  # per stage, its compute actions so far
        for i, a in enumerate(program):
            ran[a.stage] += a.kind.is_compute
            for sender, _, direction, mb in released.get(i, ()):
                if direction == "B":
                    let_go[sender][mb] = ran[sender]
    return dict(let_go)


def _explain_deadlock(schedule: Schedule, pc: list[int]) -> str:
    """The first stuck compute, the chain of waits that holds it, and the reorderings that
    would each break the cycle, in the terms of the compute actions a user writes."""
    stuck = {s: stage[pc[s]] for s, stage in enumerate(schedule.actions) if pc[s] < len(stage)}
    s = min(stuck)
    chain, seen = [], []
    while s not in seen:  # every stuck receive's send lies ahead on a stuck peer
        seen.append(s)
        recv = stuck[s]
        send = recv.partner
        peer = schedule.actions[send.stage]
        after = Action(send.stage, _SERVES[send.kind], send.mb)
        if peer.index(after) < pc[send.stage]:  # its compute ran: the send itself comes late
            after = send
        chain.append((s, Action(s, _SERVES[recv.kind], recv.mb), recv, send, after))
        s = send.stage
    parts = []
    for i, (t, blocked, _, send, after) in enumerate(chain):
        where = f"{blocked} on stage {t}" if i == 0 else f"stage {t} is stuck earlier at {blocked}"
        parts.append(f"{where}: it needs {send}, which stage {send.stage} sends only "
                     + ("later" if after == send else f"after {after}"))
    held = {t: blocked for t, blocked, *_ in chain}
    fixes = ", or ".join(f"on stage {after.stage} run {after} before {held[after.stage]}"
                         for *_, after in chain[seen.index(s):])
    return (f"The first action that cannot proceed is {', but '.join(parts)}, behind "
            f"{held[s]}. Fix: {fixes} (every receive must be met by a send its peer reaches "
            "first)")


def lower(name: str, stages: int, micro_batches: int, edges: Iterable[tuple[int, int]],
          minibatches: int = 2, devices: int | None = None) -> Schedule:
    """The schedule called `name` with its sends and receives for the stage `edges`, checked
    to run without hanging (an asynchronous one streams `minibatches` mini-batches; one with
    several stages per device runs on `devices`)."""
    extra = {"minibatches": minibatches} if name == "async-1f1b" else {}
    if devices is not None:
        extra["devices"] = devices
    schedule = add_communication(build(name, stages, micro_batches, **extra), edges)
    check_communication(schedule)
    return schedule
