"""Schedules as plain data: actions (`1F0`, `0SF3>1`, ...) and per-stage action lists."""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from enum import Enum

from fxpipe.errors import FxpipeError

__all__ = ["Action", "ActionKind", "B", "DeadlockError", "F", "Schedule", "ScheduleError", "W"]


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

    Several stages per device (interleaved 1F1B, looped BFS, ZB-V): `placement[s]` is the device
    of stage s (None: stage s on device s), and `programs[d]` the one order device d runs its
    stages' actions in, each stage's actions in its list's order (None: each device holds one
    stage and runs its list). `device_programs` resolves both cases.
    """

    name: str
    stages: int
    micro_batches: int  # per mini-batch
    actions: tuple[tuple[Action, ...], ...]
    minibatches: int = 1
    placement: tuple[int, ...] | None = None  # device of each stage; None: stage s on device s
    programs: tuple[tuple[Action, ...], ...] | None = None  # per device, its order of actions

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
        self._check_devices()

    def _check_devices(self) -> None:
        """Placement and programs: every device holds a stage, and each program runs exactly
        its device's stages' actions, each stage's in its list's order."""
        if self.placement is not None:
            placement = tuple(self.placement)
            if len(placement) != self.stages or not all(
                    _is_index(d) and not isinstance(d, bool) for d in placement):
                raise ValueError(f"placement {placement!r} of schedule {self.name!r} must give "
                                 f"one device (an integer >= 0) for each of its {self.stages} "
                                 "stages")
            placement = tuple(operator.index(d) for d in placement)
            empty = sorted(set(range(max(placement) + 1)) - set(placement))
            if empty:
                raise ValueError(f"placement {placement} of schedule {self.name!r} leaves devices "
                                 f"{empty} without a stage; number the devices 0..D-1")
            object.__setattr__(self, "placement", placement)
        if self.programs is None:
            shared = [d for d in range(self.devices) if len(self.stages_on(d)) > 1]
            if shared:
                raise ValueError(f"devices {shared} of schedule {self.name!r} hold several stages; "
                                 "give programs: one ordered list of actions per device")
            return
        programs = tuple(tuple(program) for program in self.programs)
        object.__setattr__(self, "programs", programs)
        if len(programs) != self.devices:
            raise ValueError(f"schedule {self.name!r} has {len(programs)} programs for "
                             f"{self.devices} devices; give one per device")
        for d, program in enumerate(programs):
            for a in program:
                if not isinstance(a, Action) or not 0 <= a.stage < self.stages \
                        or self.device(a.stage) != d:
                    where = (f"stage {a.stage} is on device {self.device(a.stage)}"
                             if isinstance(a, Action) and 0 <= a.stage < self.stages
                             else "it is no action of a stage of this schedule")
                    raise ValueError(f"device {d}'s program holds {a!r}, but {where}; a program "
                                     "holds only the actions of its device's stages")
        for d, program in enumerate(programs):
            for s in self.stages_on(d):
                ran = tuple(a for a in program if a.stage == s)
                if ran != self.actions[s]:
                    i = next((i for i, (x, y) in enumerate(zip(ran, self.actions[s]))
                              if x != y), min(len(ran), len(self.actions[s])))
                    got = str(ran[i]) if i < len(ran) else "nothing more"
                    want = str(self.actions[s][i]) if i < len(self.actions[s]) else "nothing more"
                    raise ValueError(
                        f"device {d}'s program runs {got} as stage {s}'s action {i}, but stage "
                        f"{s}'s list has {want} there; a program runs each of its stages' "
                        "actions exactly once, in the stage's order")

    @classmethod
    def from_lists(
        cls,
        lists: Sequence[Sequence[Action | str]],
        name: str = "custom",
        micro_batches: int | None = None,
        minibatches: int = 1,
        placement: Sequence[int] | None = None,
        programs: Sequence[Sequence[Action | str]] | None = None,
    ) -> Schedule:
        """A schedule from per-stage lists of actions or their compact strings (and, with
        several stages per device, the placement and per-device programs, likewise)."""
        def parsed(items: Sequence[Sequence[Action | str]]) -> tuple[tuple[Action, ...], ...]:
            return tuple(tuple(a if isinstance(a, Action) else Action.parse(a) for a in row)
                         for row in items)

        actions = parsed(lists)
        if micro_batches is None:
            mbs = [a.mb for stage in actions for a in stage
                   if a.mb is not None and a.kind not in _MINIBATCH_KINDS]
            micro_batches = (max(mbs, default=0) + 1 + minibatches - 1) // minibatches
        return cls(name, len(actions), micro_batches, actions, minibatches, placement,
                   None if programs is None else parsed(programs))

    def __getitem__(self, stage: int) -> tuple[Action, ...]:
        return self.actions[stage]

    def __str__(self) -> str:
        head = (f"{self.name}: {self.stages} stages x {self.micro_batches} micro-batches"
                + (f" x {self.minibatches} mini-batches" if self.minibatches > 1 else "")
                + (f" on {self.devices} devices" if self.placement is not None else ""))
        lines = [head, *(f"{s}: " + " ".join(map(str, a)) for s, a in enumerate(self.actions))]
        if self.placement is not None:
            lines += [f"device {d}: " + " ".join(map(str, program))
                      for d, program in enumerate(self.device_programs)]
        return "\n".join(lines)

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

    @property
    def devices(self) -> int:
        """How many devices run the schedule: one per stage unless `placement` shares them."""
        return self.stages if self.placement is None else max(self.placement) + 1

    def device(self, stage: int) -> int:
        """The device stage `stage` runs on."""
        return stage if self.placement is None else self.placement[stage]

    def stages_on(self, device: int) -> tuple[int, ...]:
        """The stages placed on `device`, in increasing order."""
        if self.placement is None:
            return (device,)
        return tuple(s for s, d in enumerate(self.placement) if d == device)

    @property
    def device_programs(self) -> tuple[tuple[Action, ...], ...]:
        """What each device runs, in order: `programs`, or its one stage's list."""
        if self.programs is not None:
            return self.programs
        return tuple(self.actions[self.stages_on(d)[0]] for d in range(self.devices))

    def _replace(self, actions: Iterable[Iterable[Action]]) -> Schedule:
        actions = tuple(tuple(a) for a in actions)
        if self.programs is None:
            return dataclasses.replace(self, actions=actions)
        owners = [self.stages_on(d) for d in range(self.devices)]
        programs = _carry(self.programs, owners, self.actions, actions)
        return dataclasses.replace(self, actions=actions, programs=programs)


def _carry(programs: tuple[tuple[Action, ...], ...], owners: Sequence[tuple[int, ...]],
           old: tuple[tuple[Action, ...], ...],
           new: tuple[tuple[Action, ...], ...]) -> tuple[tuple[Action, ...], ...]:
    """The programs with the actions `new` adds to the stages' lists `old`: a receive joins the
    program just before the next action of its stage (a device blocks on it, so not earlier);
    anything else (a send, a STEP) just after the one before it."""
    before, after, tail = defaultdict(list), defaultdict(list), defaultdict(list)
    for s, (was, now) in enumerate(zip(old, new)):
        kept, anchor, pending = set(was), None, []
        for a in now:
            if a in kept:
                before[a] += pending
                anchor, pending = a, []
            elif a.kind.is_recv or anchor is None:
                pending.append(a)
            else:
                after[anchor].append(a)
        if anchor is None:
            tail[s] += pending
        else:
            after[anchor] += pending
    kept = {a for stage in new for a in stage}
    carried = []
    for program, stages in zip(programs, owners):
        order = [x for a in program
                 for x in (*before[a], *((a,) if a in kept else ()), *after[a])]
        carried.append(tuple(order) + tuple(x for s in stages for x in tail[s]))
    return tuple(carried)


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not _is_index(value) or operator.index(value) < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return operator.index(value)


