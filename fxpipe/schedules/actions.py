"""Schedules as plain data: actions (`1F0`, `0SF3>1`, ...) and per-stage action lists."""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
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


