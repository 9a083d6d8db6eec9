"""Pipeline schedules as plain data: per-stage action lists, their generators and lowering."""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from enum import Enum

from fxpipe.errors import FxpipeError

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "B",
    "DeadlockError",
    "F",
    "Schedule",
    "ScheduleError",
    "W",
    "add_communication",
    "add_step",
    "async_one_f_one_b",
    "build",
    "chain",
    "check_communication",
    "forwards_first",
    "gpipe",
    "lower",
    "one_f_one_b",
    "peak_activations",
]


class ScheduleError(FxpipeError):
    """A schedule that no runtime could execute as written; the message says what to change."""


class DeadlockError(ScheduleError):
    """A schedule whose stages wait on each other forever."""


class ActionKind(str, Enum):
    """What an action does; the value is its code in the compact form."""

    F = "F"  # forward of one micro-batch
    B = "B"  # backward (input and weight gradients; input gradient only when W is split off)
    W = "W"  # weight gradient, for zero-bubble schedules
    SEND_F = "SF"  # send activations to a later stage
    RECV_F = "RF"  # receive activations from an earlier stage
    SEND_B = "SB"  # send an input gradient back to the stage that produced the input
    RECV_B = "RB"  # receive the gradient of an output from a later stage
    ALLREDUCE = "AR"  # all-reduce the stage's gradients across data-parallel groups
    STEP = "STEP"  # optimizer step of the stage

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_send(self) -> bool:
        return self is ActionKind.SEND_F or self is ActionKind.SEND_B

    @property
    def is_recv(self) -> bool:
        return self is ActionKind.RECV_F or self is ActionKind.RECV_B


F, B, W = ActionKind.F, ActionKind.B, ActionKind.W
_COMPUTE = frozenset({F, B, W})
_MINIBATCH_KINDS = frozenset({ActionKind.ALLREDUCE, ActionKind.STEP})
_DOWNSTREAM = frozenset({ActionKind.SEND_F, ActionKind.RECV_B})  # the peer is a later stage
# the kind a send or receive pairs with on its peer, and the compute it serves
_PARTNER = {
    ActionKind.SEND_F: ActionKind.RECV_F, ActionKind.RECV_F: ActionKind.SEND_F,
    ActionKind.SEND_B: ActionKind.RECV_B, ActionKind.RECV_B: ActionKind.SEND_B,
}
_SERVES = {ActionKind.SEND_F: F, ActionKind.RECV_F: F, ActionKind.SEND_B: B, ActionKind.RECV_B: B}
_GRAMMAR = "<stage><kind>[<mb>][('>' | '<')<peer>], e.g. 1F0, 0SF3>1, 1RF3<0, 0STEP"
_PATTERN = re.compile(r"(\d+)([A-Z]+)(\d*)(?:([<>])(\d+))?")


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    """One step of one stage: compute, a send or receive with `peer`, a reduction or a step.

    Compact form `<stage><kind>[<mb>][('>' | '<')<peer>]`, `str(a)` and `Action.parse`:

        1F0      stage 1, forward of micro-batch 0 (1B0 backward, 1W0 weight gradient)
        0SF3>1   stage 0 sends micro-batch 3's activations to stage 1
        1RF3<0   stage 1 receives them from stage 0
        1SB3>0   stage 1 sends micro-batch 3's input gradient back to stage 0
        0RB3<1   stage 0 receives it from stage 1
        0AR 0STEP     all-reduce stage 0's gradients, step its optimizer (single mini-batch)
        0AR1 0STEP1   the same, closing mini-batch 1 of a multi-mini-batch schedule

    `mb` numbers micro-batches from 0 across the whole schedule (see `Schedule`); for STEP and
    ALLREDUCE it is the mini-batch they close, None when the schedule holds one mini-batch.
    """

    stage: int
    kind: ActionKind
    mb: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        kind = self.kind
        if type(kind) is not ActionKind:
            try:
                kind = ActionKind(kind)
            except ValueError:
                codes = " ".join(k.value for k in ActionKind)
                raise ValueError(f"unknown action kind {kind!r}; use one of {codes}") from None
            object.__setattr__(self, "kind", kind)
        for field in ("stage", "mb", "peer"):
            value = getattr(self, field)
            if (type(value) is int and value >= 0) or (value is None and field != "stage"):
                continue  # the common case, checked fast
            if isinstance(value, bool) or not _is_index(value):
                raise ValueError(f"Action.{field} must be a non-negative integer, not {value!r}")
            object.__setattr__(self, field, operator.index(value))
        communicates = kind in _PARTNER
        if self.mb is None and kind not in _MINIBATCH_KINDS:
            raise ValueError(f"{kind.name} needs a micro-batch: "
                             f"Action({self.stage}, {kind.name}, mb)")
        if communicates != (self.peer is not None):
            need = "needs the peer stage" if communicates else "takes no peer"
            raise ValueError(f"{kind.name} {need} (got peer={self.peer!r})")
        if communicates and (self.peer > self.stage) != (kind in _DOWNSTREAM):
            way = "a later" if kind in _DOWNSTREAM else "an earlier"
            raise ValueError(
                f"{kind.name} on stage {self.stage} goes to {way} stage, not to {self.peer}: "
                "activations flow to later stages, gradients back to earlier ones"
            )

    def __str__(self) -> str:
        mb = "" if self.mb is None else str(self.mb)
        if self.peer is None:
            return f"{self.stage}{self.kind.value}{mb}"
        arrow = ">" if self.kind.is_send else "<"
        return f"{self.stage}{self.kind.value}{mb}{arrow}{self.peer}"

    __repr__ = __str__

    @property
    def partner(self) -> Action:
        """The receive a send pairs with on its peer, or the send a receive waits for."""
        if self.kind not in _PARTNER:
            raise ValueError(f"{self} is not a send or a receive, so it has no partner")
        return Action(self.peer, _PARTNER[self.kind], self.mb, self.stage)

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action `str(action)` printed: `Action.parse("1F0") == Action(1, F, 0)`."""
        match = _PATTERN.fullmatch(text.strip())
        if match is None or match[2] not in ActionKind._value2member_map_:
            raise ValueError(f"cannot parse action {text!r}: expected {_GRAMMAR}")
        stage, code, mb, arrow, peer = match.groups()
        kind = ActionKind(code)
        if arrow is not None and arrow != (">" if kind.is_send else "<"):
            hint = "'>' for sends" if kind.is_send else "'<' for receives" if kind.is_recv else ""
            raise ValueError(f"cannot parse action {text!r}: {kind.name} takes {hint or 'no peer'}")
        return cls(int(stage), kind, int(mb) if mb else None, int(peer) if peer else None)


def _is_index(value: object) -> bool:
    try:
        return operator.index(value) >= 0
    except TypeError:
        return False


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per-stage ordered action lists: `actions[s]` is what stage s runs, in order.

    Generators return compute-only lists; lowering is a chain of pure functions, each returning
    a new schedule: `add_communication` (SEND/RECV pairs), then `add_step` (STEP, and ALLREDUCE
    for data-parallel groups). `check_communication` proves a lowered schedule cannot hang and
    `fxpipe.simulate.simulate` times any of them.

    Micro-batch `mb` belongs to mini-batch `mb // micro_batches`: synchronous schedules hold one
    mini-batch (mb in 0..p-1), async-1f1b streams `minibatches` of them with no flush.

    Weight versions: a stage starts at version 0 and every STEP on it adds one, so
    `weight_version(action)` (STEPs before the action in its list) is the version it meets with
    no consistency policy ("none"); sequential training would use version `minibatch(action)`.
    "stash" runs B(mb) with the version F(mb) met; "predict" (PipeOptim) runs F(mb) with weights
    predicted `weight_version(B) - weight_version(F)` updates ahead.
    """

    name: str
    stages: int
    micro_batches: int  # per mini-batch
    actions: tuple[tuple[Action, ...], ...]
    minibatches: int = 1

    def __post_init__(self) -> None:
        actions = tuple(tuple(stage) for stage in self.actions)
        object.__setattr__(self, "actions", actions)
        for field in ("stages", "micro_batches", "minibatches"):
            _positive(field, getattr(self, field))
        if len(actions) != self.stages:
            raise ValueError(f"schedule {self.name!r} has {len(actions)} action lists for "
                             f"{self.stages} stages; give one list per stage")
        total = self.micro_batches * self.minibatches
        for s, stage in enumerate(actions):
            if len(set(stage)) != len(stage):
                twice = sorted({str(a) for a in stage if stage.count(a) > 1})
                raise ValueError(f"stage {s} of schedule {self.name!r} lists {twice} twice")
            for a in stage:
                if not isinstance(a, Action) or a.stage != s:
                    raise ValueError(f"stage {s}'s list holds {a!r}; it may only hold Actions "
                                     f"of stage {s}")
                if a.peer is not None and a.peer >= self.stages:
                    raise ValueError(f"{a} talks to stage {a.peer}, past the last stage")
                limit = self.minibatches if a.kind in _MINIBATCH_KINDS else total
                if a.mb is not None and a.mb >= limit:
                    raise ValueError(f"{a} is out of range: schedule {self.name!r} has "
                                     f"{self.minibatches} mini-batch(es) of {self.micro_batches}")

    @classmethod
    def from_lists(
        cls,
        lists: Sequence[Sequence[Action | str]],
        name: str = "custom",
        micro_batches: int | None = None,
        minibatches: int = 1,
    ) -> Schedule:
        """A schedule from per-stage lists of actions or their compact strings."""
        actions = tuple(tuple(a if isinstance(a, Action) else Action.parse(a) for a in stage)
                        for stage in lists)
        if micro_batches is None:
            mbs = [a.mb for stage in actions for a in stage
                   if a.mb is not None and a.kind not in _MINIBATCH_KINDS]
            micro_batches = (max(mbs, default=0) + 1 + minibatches - 1) // minibatches
        return cls(name, len(actions), micro_batches, actions, minibatches)

    def __getitem__(self, stage: int) -> tuple[Action, ...]:
        return self.actions[stage]

    def __str__(self) -> str:
        head = (f"{self.name}: {self.stages} stages x {self.micro_batches} micro-batches"
                + (f" x {self.minibatches} mini-batches" if self.minibatches > 1 else ""))
        return "\n".join([head, *(f"{s}: " + " ".join(map(str, a))
                                  for s, a in enumerate(self.actions))])

    @property
    def lowered(self) -> bool:
        """Whether the lists already hold SEND/RECV actions."""
        return any(a.kind.is_send or a.kind.is_recv for stage in self.actions for a in stage)

    def minibatch(self, action: Action) -> int:
        """The mini-batch `action` works on (the one a STEP or ALLREDUCE closes)."""
        if action.kind in _MINIBATCH_KINDS:
            return action.mb or 0
        return action.mb // self.micro_batches

    def weight_version(self, action: Action) -> int:
        """How many optimizer STEPs its stage has done when `action` runs (0: initial weights)."""
        try:
            return self._versions[action]
        except KeyError:
            raise ValueError(f"{action} is not part of schedule {self.name!r}") from None

    @functools.cached_property
    def _versions(self) -> dict[Action, int]:
        versions = {}
        for stage in self.actions:
            steps = 0
            for a in stage:
                versions[a] = steps
                steps += a.kind is ActionKind.STEP
        return versions

    def _replace(self, actions: Iterable[Iterable[Action]]) -> Schedule:
        return dataclasses.replace(self, actions=tuple(tuple(a) for a in actions))


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not _is_index(value) or operator.index(value) < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return operator.index(value)


# --- generators: compute-only lists ----------------------------------------------------------


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """GPipe: every forward, then every backward in reverse micro-batch order (the last
    micro-batch's activations are the freshest, as autograd over the micro-batches would run)."""
    n, p = _positive("stages", stages), _positive("micro_batches", micro_batches)
    lists = [[Action(s, F, m) for m in range(p)] + [Action(s, B, m) for m in reversed(range(p))]
             for s in range(n)]
    return Schedule("gpipe", n, p, lists)


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    """1F1B with a flush (DAPPLE, PipeDream-flush): min(N-s-1, p) warm-up forwards on stage s,
    then one forward and one backward in turn, then the remaining backwards."""
    n, p = _positive("stages", stages), _positive("micro_batches", micro_batches)
    return Schedule("1f1b", n, p, [_one_f_one_b(s, n, p) for s in range(n)])


def async_one_f_one_b(stages: int, micro_batches: int, minibatches: int = 2) -> Schedule:
    """PipeDream's asynchronous 1F1B: `minibatches` mini-batches of `micro_batches` stream through
    one 1F1B pipeline with no flush, and every stage steps right after its backward of the last
    micro-batch of each mini-batch (PipeDream for p = 1, PipeDream-2BW's accumulation for p > 1)."""
    n, p = _positive("stages", stages), _positive("micro_batches", micro_batches)
    k = _positive("minibatches", minibatches)
    lists = []
    for s in range(n):
        stage = []
        for a in _one_f_one_b(s, n, p * k):
            stage.append(a)
            if a.kind is B and a.mb % p == p - 1:
                stage.append(Action(s, ActionKind.STEP, a.mb // p))
        lists.append(stage)
    return Schedule("async-1f1b", n, p, lists, k)


def _one_f_one_b(stage: int, stages: int, count: int) -> list[Action]:
    warmup = min(stages - stage - 1, count)
    actions = [Action(stage, F, m) for m in range(warmup)]
    for m in range(count - warmup):
        actions += [Action(stage, F, m + warmup), Action(stage, B, m)]
    return actions + [Action(stage, B, m) for m in range(count - warmup, count)]


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "async-1f1b": async_one_f_one_b,
}


def build(name: str, stages: int, micro_batches: int, **kw: int) -> Schedule:
    """The compute-only schedule called `name` (a key of SCHEDULES)."""
    if name not in SCHEDULES:
        known = ", ".join(repr(k) for k in SCHEDULES)
        raise ValueError(f"unknown schedule {name!r}; choose one of {known}")
    return SCHEDULES[name](stages, micro_batches, **kw)


def lower(name: str, stages: int, micro_batches: int, edges: Iterable[tuple[int, int]],
          minibatches: int = 2) -> Schedule:
    """The schedule called `name` with its sends and receives for the stage `edges`, checked
    to run without hanging (an asynchronous one streams `minibatches` mini-batches)."""
    extra = {"minibatches": minibatches} if name == "async-1f1b" else {}
    schedule = add_communication(build(name, stages, micro_batches, **extra), edges)
    check_communication(schedule)
    return schedule


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations are held at once (F done, B not)."""
    peaks = []
    for stage in schedule.actions:
        held = peak = 0
        for a in stage:
            held += (a.kind is F) - (a.kind is B)
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def forwards_first(actions: Sequence[Action]) -> bool:
    """Whether a stage's `actions` run every forward before the first backward (GPipe), so the
    stage holds every micro-batch's inputs until its backward anyway. The runtime posts all
    the receives of such a stage at the start of a run, and otherwise each one just before
    the compute ahead of it."""
    kinds = [a.kind for a in actions]
    return B not in kinds or F not in kinds[kinds.index(B):]


# --- lowering ---------------------------------------------------------------------------------


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


def add_step(schedule: Schedule, allreduce: bool = False) -> Schedule:
    """Close every mini-batch on every stage with a STEP (after the stage's last action of that
    mini-batch), preceded by an ALLREDUCE when `allreduce`; mini-batches already closed stay."""
    kinds = [ActionKind.ALLREDUCE] * allreduce + [ActionKind.STEP]
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
    matched first-in first-out.
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
    channels: dict[tuple[int, int], deque[Action]] = defaultdict(deque)
    pc = [0] * schedule.stages
    progress = True
    while progress:
        progress = False
        for s, stage in enumerate(schedule.actions):
            while pc[s] < len(stage):
                a = stage[pc[s]]
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
                pc[s] += 1
                progress = True
    waiting = [(s, stage[pc[s]]) for s, stage in enumerate(schedule.actions) if pc[s] < len(stage)]
    if waiting:
        waits = "; ".join(f"stage {s} waits at {a} (action {pc[s]}) for {a.partner}"
                          for s, a in waiting)
        raise DeadlockError(f"schedule {schedule.name!r} deadlocks: {waits}. Reorder the lists so "
                            "every receive is met by a send its peer reaches first")
