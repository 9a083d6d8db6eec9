"""Memory model: what each stage holds at its peak, shared by the planners and print(pipe)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from fxpipe.policy_copies import stage_copies
from fxpipe.schedules import (
    Action,
    ActionKind,
    Schedule,
    build,
    forwards_first,
    gradients_let_go,
    peak_activations,
)

__all__ = [
    "CAST_COPIES",
    "FIELDS",
    "MemoryBudget",
    "Peak",
    "StageBytes",
    "StageMemory",
    "device_peaks",
    "in_flight",
    "peak_of",
    "stage_actions",
    "stage_let_go",
    "stage_memory",
    "stage_peak",
    "stage_terms",
    "workspace_bytes",
]


# what autocast's bf16/fp16 copies of a stage's weights cost, in their bytes: the copies, which
# the stage keeps for the whole step (fxpipe.precision.weight_casts_kept), and their
# gradients in the same dtype, which a backward holds until its end: the copies' cast node is
# the oldest in the graph (made at the step's first forward), and autograd runs the oldest
# last, so every weight's gradient waits for the backward's other work. Counted for the
# whole step, as the peak is at a backward.
CAST_COPIES = 2.0


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """One stage's predicted peak, in bytes, by what holds it."""

    weights: float
    gradients: float
    optimizer: float  # the optimizer's state: slots × the weights' bytes
    activations: float  # what autograd saves, × the micro-batches in flight at the peak
    boundary: float = 0.0  # received inputs and sent outputs held between stages
    workspace: float = 0.0  # transient: a weight's new gradient before it is accumulated
    casts: float = 0.0  # autocast's copies of the weights and their gradients (CAST_COPIES)
    copies: float = 0.0  # the weight versions a consistency policy keeps (stash, 2bw, predict)

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.activations
                + self.boundary + self.workspace + self.casts + self.copies)


def in_flight(schedule: str | Schedule, stages: int, p: int,
              devices: int | None = None) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations it holds at once under `schedule`
    (a name, built for `stages` and `p`, on `devices` where it places several stages on one;
    or a user's Schedule): the schedule's own `peak_activations`."""
    if isinstance(schedule, Schedule):
        return peak_activations(schedule)
    return _named_in_flight(schedule, stages, p, devices)


@functools.lru_cache(maxsize=256)  # planners ask for the same (schedule, stages, p) many times
def _named_in_flight(name: str, stages: int, p: int, devices: int | None) -> tuple[int, ...]:
    extra = {} if devices is None else {"devices": devices}
    try:
        return peak_activations(build(name, stages, p, **extra))
    except ValueError:  # a count or placement it cannot run (the schedule pass says so): at
        return (p,) * stages  # most every micro-batch at once


def stage_memory(param_bytes: np.ndarray | Sequence[float], saved_bytes: np.ndarray |
                 Sequence[float], held: int, *, optimizer_slots: float = 2.0,
                 boundary: float = 0.0, workspace: float = 0.0,
                 activations: float | None = None, casts: float = 0.0,
                 copies: float = 0.0) -> StageMemory:
    """The peak of a stage made of units with these `param_bytes` and per-micro-batch
    `saved_bytes` (what autograd saves), holding `held` micro-batches' activations at once,
    trained by an optimizer with `optimizer_slots` copies of the weights (Adam: 2), plus
    `boundary` bytes of messages and `workspace` (`workspace_bytes`); `activations`: the
    bytes of activations held at the peak where known (`stage_peak`), for held × saved;
    `casts`: the bytes of autocast's copies of the weights (Plan(precision)), counted
    CAST_COPIES times; `copies`: how many more copies of the weights a consistency policy
    keeps (`weight_copies`)."""
    weights = float(np.sum(param_bytes))
    if activations is None:
        activations = held * float(np.sum(saved_bytes))
    return StageMemory(weights, weights, optimizer_slots * weights, activations, boundary,
                       workspace, CAST_COPIES * casts, copies * weights)


def workspace_bytes(param_bytes: np.ndarray, grads_in: np.ndarray, grads_out: np.ndarray,
                    micro_batches: int) -> float:
    """The most a stage's backward holds beyond its activations, over its units (per unit:
    its `param_bytes`, and per micro-batch the gradients of its inputs and outputs): a
    unit's backward holds its output's gradient while it makes its input's; over several
    micro-batches a weight's new gradient is held beside .grad until added to it."""
    accumulating = np.asarray(param_bytes) if micro_batches > 1 else 0.0
    return float(np.max(np.asarray(grads_in) + grads_out + accumulating, initial=0.0))


@dataclasses.dataclass(frozen=True)
class StageBytes:
    """What one stage's micro-batch holds, in bytes, for `stage_peak`."""

    saved: float  # what autograd saves (of its units' making)
    received: float = 0.0  # inputs received, kept for the micro-batch's backward
    sent: float = 0.0  # outputs sent on: held by the send until the micro-batch's backward
    sent_saved: float = 0.0  # of `sent`, what autograd saves (in `saved` until the backward)
    received_grads: float = 0.0  # its outputs' gradients, received
    sent_grads: float = 0.0  # its inputs' gradients, sent back: held until the step ends
    workspace: float = 0.0  # the most a backward holds beyond these (`workspace_bytes`)
    # recomputing (`fxpipe.segments`): the bytes kept at the cuts between its checkpointed
    # segments, and what the largest segment saves (its recompute holds it again)
    kept: float = 0.0
    segment: float = 0.0


@dataclasses.dataclass(frozen=True)
class Peak:
    """A stage's (or a device's) peak over a step, in bytes: the activations it holds then,
    and the message buffers and backward workspace it holds besides."""

    activations: float  # what autograd saves, of the micro-batches held then
    boundary: float
    workspace: float

    @property
    def total(self) -> float:
        return self.activations + self.boundary + self.workspace


def stage_peak(actions: Sequence[Action], stages: dict[int, StageBytes],
               let_go: Mapping[int, Mapping[int, int]] | None = None) -> Peak:
    """The peak of a device running `actions` (one stage's, or a device's program of several)
    with these per-micro-batch `stages` bytes, walked action by action as torchrun's
    transport runs them: a stage keeps its received inputs until the micro-batch's backward
    (its weight gradient's, where split); an output it sends until that micro-batch's
    backward (its gradient came back, so the receiver has it and the transport lets the send
    go: `fxpipe.schedules.delivered_sends`), a gradient it sends back until the stage's
    compute action `let_go[stage][mb]` (`stage_let_go`; absent: the step's end);
    receives are posted ahead, all of a step's at its start where the stage runs every
    forward before a backward (GPipe), else the next one.
    Stages of one process on one device hand values over without these copies: for them
    this is an upper bound."""
    own = {s: [a for a in actions if a.stage == s] for s in {a.stage for a in actions}}
    first = {s: forwards_first(mine) for s, mine in own.items()}
    split = {(a.stage, a.mb) for a in actions if a.kind is ActionKind.W}
    left_f = {s: sum(a.kind is ActionKind.F for a in mine) for s, mine in own.items()}
    left_b = {s: sum(a.kind is ActionKind.B for a in mine) for s, mine in own.items()}
    # posted at the start: a forwards-first stage's receives, all of them
    buffers = sum(q.received * left_f[s] for s, q in stages.items() if s in own and first[s])
    activations, best = 0.0, Peak(0.0, 0.0, 0.0)
    ran = dict.fromkeys(own, 0)  # per stage, its compute actions so far
    for a in actions:
        if not a.kind.is_compute:
            continue
        q, s = stages[a.stage], a.stage
        buffers -= q.sent_grads * sum(at == ran[s] for at in (let_go or {}).get(s, {}).values())
        ran[s] += 1
        left_f[s] -= a.kind is ActionKind.F
        releases = a.kind is ActionKind.W or (a.kind is ActionKind.B and (s, a.mb) not in split)
        if a.kind is ActionKind.F:
            activations += q.saved
            buffers += (0.0 if first[s] else q.received) + q.sent - q.sent_saved
        ahead = sum(stages[t].received_grads * (left_b[t] if first[t] else min(left_b[t], 1))
                    + (0.0 if first[t] or not left_f[t] else stages[t].received)
                    for t in own)
        if a.kind is ActionKind.B:  # its send was received: of it, only what autograd saves stays
            buffers -= q.sent - q.sent_saved
        workspace = 0.0 if a.kind is ActionKind.F else q.workspace
        if activations + buffers + ahead + workspace > best.total:  # a Peak only when higher
            best = Peak(activations, buffers + ahead, workspace)
        if a.kind is ActionKind.B:
            left_b[s] -= 1
            buffers += q.sent_grads
        if releases:
            activations -= q.saved
            buffers -= q.received
    return best


def device_peaks(schedule: str | Schedule, stages: int, p: int,
                 per_stage: Sequence[StageBytes]) -> tuple[Peak, ...]:
    """`stage_peak` of every action list of `schedule` (a name, built for `stages` and `p`,
    or a user's Schedule)."""
    return tuple(stage_peak(actions, dict(enumerate(per_stage)))
                 for actions in _compute_lists(schedule, stages, p))


def _compute_lists(schedule: str | Schedule, stages: int, p: int):
    if isinstance(schedule, Schedule):
        return [tuple(a for a in actions if a.kind.is_compute) for actions in schedule.actions]
    return _named_lists(schedule, stages, p)


@functools.lru_cache(maxsize=256)  # planners ask for the same (schedule, stages, p) many times
def _named_lists(name: str, stages: int, p: int) -> tuple[tuple[Action, ...], ...]:
    try:
        built = build(name, stages, p)
    except ValueError:  # a count it cannot run: gpipe's order, every micro-batch at once
        built = build("gpipe", stages, p)
    return tuple(tuple(a for a in actions if a.kind.is_compute) for actions in built.actions)


# StageBytes' byte fields, in the order of `stage_terms`' coefficients
FIELDS = ("saved", "received", "sent", "sent_saved", "received_grads", "sent_grads", "workspace",
          "kept", "segment")
_E = {name: np.eye(len(FIELDS))[i] for i, name in enumerate(FIELDS)}


def stage_terms(actions: Sequence[Action], recompute: bool = False,
                let_go: Mapping[int, int] | None = None) -> np.ndarray:
    """`stage_peak`'s walk of ONE stage's `actions`, run symbolically: (T, 3, len(FIELDS)),
    per step t of the walk the coefficients of StageBytes' FIELDS in what it holds then as
    activations, message buffers and workspace, so that the stage's peak is max_t
    Σ coefficients · fields (`peak_of`), for any bytes: the planners evaluate it for every
    (first, last unit) at once.

    A stage that `recompute`s runs as checkpointed segments (`fxpipe.segments`): per
    micro-batch it keeps the values at the cuts between them (its received inputs and sent
    outputs are held anyway) until its backward, which holds the largest segment's saved
    activations again as workspace. Where the backward is split (B then W) the stage is
    checkpointed whole, keeping only its inputs, and B runs its whole forward again, held
    until W.

    `let_go` (`stage_let_go`): per micro-batch, the index among `actions`' compute actions
    from which the input gradient the stage sent back is let go (the transport knows it
    received); a micro-batch not in it holds its gradient until the step ends."""
    let_go = let_go or {}
    zero = np.zeros(len(FIELDS))
    first = forwards_first(actions)
    split = {a.mb for a in actions if a.kind is ActionKind.W}
    left_f = sum(a.kind is ActionKind.F for a in actions)
    left_b = sum(a.kind is ActionKind.B for a in actions)
    act, buf = zero.copy(), (_E["received"] * left_f if first else zero.copy())
    rows = []
    for a in actions:
        if not a.kind.is_compute:
            continue
        left_f -= a.kind is ActionKind.F
        releases = a.kind is ActionKind.W or (a.kind is ActionKind.B and a.mb not in split)
        buf = buf - _E["sent_grads"] * sum(at == len(rows) for at in let_go.values())
        if a.kind is ActionKind.F:
            buf = buf + (zero if first else _E["received"]) + _E["sent"]
            if not recompute:  # of the sent outputs, what autograd saves is counted as saved
                act, buf = act + _E["saved"], buf - _E["sent_saved"]
            elif a.mb not in split:
                act = act + _E["kept"]
        if recompute and a.kind is ActionKind.B and a.mb in split:
            act = act + _E["saved"]  # recomputed before B, held until W
        if a.kind is ActionKind.B:  # its send was received (see stage_peak)
            buf = buf - _E["sent"] + (zero if recompute else _E["sent_saved"])
        ahead = (_E["received_grads"] * (left_b if first else min(left_b, 1))
                 + (zero if first or not left_f else _E["received"]))
        workspace = zero if a.kind is ActionKind.F else _E["workspace"] + (
            _E["segment"] if recompute and a.kind is ActionKind.B and a.mb not in split else zero)
        rows.append((act, buf + ahead, workspace))
        if a.kind is ActionKind.B:
            left_b -= 1
            buf = buf + _E["sent_grads"]
        if releases:
            if recompute:
                act = act - (_E["saved"] if a.kind is ActionKind.W else _E["kept"])
            else:
                act = act - _E["saved"]
            buf = buf - _E["received"]
    return np.array(rows).reshape(-1, 3, len(FIELDS))


def peak_of(terms: np.ndarray, stage: StageBytes) -> Peak:
    """The Peak `stage_terms` gives for these bytes: the step where the total is highest (the
    first such)."""
    x = np.array([getattr(stage, name) for name in FIELDS])
    parts = terms @ x  # (T, 3)
    if not len(parts):
        return Peak(0.0, 0.0, 0.0)
    t = int(np.argmax(parts.sum(1)))
    return Peak(*(float(v) for v in parts[t]))


def stage_actions(schedule: str | Schedule, stages: int, p: int) -> tuple[tuple[Action, ...], ...]:
    """Per stage, its own compute actions under `schedule` (a name, built for `stages` and p,
    or a user's Schedule), in its device's order."""
    lists = _compute_lists(schedule, stages, p)
    return tuple(tuple(a for a in actions if a.stage == s)
                 for s in range(stages) for actions in lists if any(a.stage == s for a in actions))


@functools.lru_cache(maxsize=1024)  # the planners ask for every stage at every count
def named_terms(schedule: str, stages: int, p: int, s: int, recompute: bool) -> np.ndarray:
    """`stage_terms` of stage s of the named schedule."""
    return stage_terms(stage_actions(schedule, stages, p)[s], recompute,
                       stage_let_go(schedule, stages, p).get(s))


@functools.lru_cache(maxsize=256)  # the planners ask for every stage at every count
def stage_let_go(schedule: str | Schedule, stages: int, p: int) -> dict[int, dict[int, int]]:
    """`gradients_let_go` of the schedule `stage_actions` walks (a name, built for `stages`
    and p, or a user's Schedule)."""
    if isinstance(schedule, Schedule):
        return gradients_let_go(schedule)
    try:
        built = build(schedule, stages, p)
    except ValueError:  # as _named_lists: gpipe's order
        built = build("gpipe", stages, p)
    return gradients_let_go(built)


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """What a planner must fit: a cap in bytes per stage (one value: every stage's; inf: no
    cap), and how a stage's memory is counted: the schedule (a name built for the stages, or a
    Schedule) whose actions `stage_terms` walks, the optimizer's slots, and recomputation
    (False, True, "auto": where needed to fit, or one bool per stage)."""

    limit: float | tuple[float, ...] = math.inf
    schedule: str | Schedule = "gpipe"
    optimizer_slots: float = 2.0
    recompute: bool | str | tuple[bool, ...] = False
    devices: int | None = None
    # each stage's device where several share one (each then capped at an equal share of its
    # device's cap); () : a device per stage
    placement: tuple[int, ...] = ()
    # why no stage can recompute under the plan's schedule or weight policy
    # (`fxpipe.recompute_spec.cannot_recompute`), None where they can: an error then does
    # not suggest recomputation
    cannot_recompute: str | None = None
    consistency: str = "none"  # Plan(consistency): the weight copies it keeps count too

    def kept(self, param_bytes: np.ndarray, cast_bytes: np.ndarray, stages: int, p: int,
             s: int) -> np.ndarray:
        """(K+1,) prefix sums over the units of what stage s holds for the whole step: its
        weights, their gradients, the optimizer's slots and the policy's copies of them, and
        autocast's casts of them (`cast_bytes`, CAST_COPIES times)."""
        copies = stage_copies(self.consistency, self.schedule, stages, p, s)
        per_unit = ((2.0 + self.optimizer_slots + copies) * np.asarray(param_bytes)
                    + CAST_COPIES * np.asarray(cast_bytes))
        return np.concatenate([[0.0], np.cumsum(per_unit)])

    def limits(self, stages: int) -> np.ndarray:
        """(stages,) the cap of each stage, in bytes."""
        if isinstance(self.limit, tuple):
            if len(self.limit) != stages:
                raise ValueError(f"the memory cap lists {len(self.limit)} stages' limits for "
                                 f"{stages} stages; give one per stage or a single value")
            return np.asarray(self.limit, dtype=np.float64)
        return np.full(stages, float(self.limit))

    def held(self, stages: int, p: int) -> tuple[int, ...]:
        return in_flight(self.schedule, stages, p, self.devices)

    def terms(self, stages: int, p: int, s: int, recompute: bool) -> np.ndarray:
        """`stage_terms` of stage s under this budget's schedule."""
        if isinstance(self.schedule, Schedule):
            return stage_terms(stage_actions(self.schedule, stages, p)[s], recompute,
                               stage_let_go(self.schedule, stages, p).get(s))
        return named_terms(self.schedule, stages, p, s, recompute)

    def modes(self, stages: int) -> tuple[tuple[bool, ...], ...]:
        """Per stage, the recomputation settings a planner may choose from."""
        if self.recompute == "auto":
            return ((False, True),) * stages
        if isinstance(self.recompute, tuple):
            if len(self.recompute) != stages:
                raise ValueError(f"recompute lists {len(self.recompute)} stages for {stages}")
            return tuple((bool(r),) for r in self.recompute)
        return ((bool(self.recompute),),) * stages

    @property
    def may_recompute(self) -> bool:
        """Whether any stage may recompute."""
        if isinstance(self.recompute, tuple):
            return any(self.recompute)
        return self.recompute is True or self.recompute == "auto"

    @property
    def capped(self) -> bool:
        limit = self.limit if isinstance(self.limit, tuple) else (self.limit,)
        return any(math.isfinite(x) for x in limit)
