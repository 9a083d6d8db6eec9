"""Schedules as PyTorch pipelining's CSV: one row per rank (device) of action strings."""

from __future__ import annotations

import csv
import os
import pathlib
import re
from collections.abc import Sequence

from fxpipe.schedules.actions import Action, ActionKind, B, F, Schedule, ScheduleError, W

__all__ = ["from_pytorch", "load_csv", "save_csv", "to_pytorch"]

K = ActionKind
# PyTorch's `_Action` repr: <stage><type>[<mb>], with its computation types' short names.
# Its SEND_F/RECV_B talk to stage + 1, SEND_B/RECV_F to stage - 1; its B is the full backward
# (fxpipe's B without a W), I the input gradient alone (fxpipe's B where a W follows), and
# REDUCE_GRAD the stage's gradient reduction over data-parallel replicas (fxpipe's ALLREDUCE).
_PATTERN = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)"
                      r"(\d*)")
_COMM = {K.SEND_F: ("SEND_F", 1), K.RECV_F: ("RECV_F", -1), K.SEND_B: ("SEND_B", -1),
         K.RECV_B: ("RECV_B", 1)}
_BY_NAME = {name: (kind, step) for kind, (name, step) in _COMM.items()}
_FSDP = ("UNSHARD", "RESHARD")


def to_pytorch(action: Action, split: bool = False) -> str:
    """PyTorch's string for `action`; `split`: a W of the same micro-batch follows this B on its
    stage, so it computes the input gradient alone (PyTorch's I)."""
    s, kind, mb = action.stage, action.kind, action.mb
    if kind in (F, B, W):
        code = "I" if kind is B and split else kind.value
        return f"{s}{code}{mb}"
    if kind in _COMM:
        name, step = _COMM[kind]
        if action.peer != s + step:
            raise ScheduleError(
                f"{action} talks to stage {action.peer}, but PyTorch's {name} only reaches stage "
                f"{s + step} (its stages form a chain); save the compute-only schedule and let "
                "fxpipe add the skip edges' messages when it compiles")
        return f"{s}{name}{mb}"
    if kind is K.ALLREDUCE and mb is None:
        return f"{s}REDUCE_GRAD"
    raise ScheduleError(f"{action} has no counterpart in PyTorch's schedule CSV (it has no "
                        "optimizer step, and one mini-batch per schedule); save a flushed "
                        "schedule without STEP actions")


def from_pytorch(text: str) -> Action | None:
    """The fxpipe action a PyTorch action string names (None for an empty cell, a bubble).
    A PyTorch I (input gradient alone) becomes fxpipe's B, which it is when a W follows."""
    text = text.strip()
    if not text:
        return None
    if text.startswith("("):
        raise ScheduleError(f"{text!r} overlaps several actions (PyTorch's OVERLAP_F_B), which "
                            "fxpipe does not run; list its sub-actions one by one")
    match = _PATTERN.fullmatch(text)
    if match is None:
        raise ScheduleError(f"cannot read {text!r} as a PyTorch action: expected "
                            "<stage><F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD>[<mb>], "
                            "e.g. 1F0, 0SEND_F3")
    s, name, mb = int(match[1]), match[2], int(match[3]) if match[3] else None
    if name in _FSDP:
        raise ScheduleError(f"{text!r} is an FSDP parameter {name.lower()}, which fxpipe does "
                            "not shard; remove the UNSHARD/RESHARD actions")
    if name == "REDUCE_GRAD":
        return Action(s, K.ALLREDUCE, mb)
    if mb is None:
        raise ScheduleError(f"{text!r} needs a micro-batch index, e.g. {s}{name}0")
    if name in _BY_NAME:
        kind, step = _BY_NAME[name]
        if s + step < 0:
            raise ScheduleError(f"{text!r}: stage {s} has no stage {s + step} to talk to")
        return Action(s, kind, mb, s + step)
    return Action(s, B if name == "I" else ActionKind(name), mb)


def save_csv(schedule: Schedule, path: str | os.PathLike) -> None:
    """Write `schedule` as PyTorch's pipelining reads it (`_load_csv`): row r lists, as
    PyTorch's `_Action` strings, the actions rank (device) r runs in order, so a schedule with
    several stages per device keeps its placement and each device's order."""
    if schedule.minibatches != 1:
        raise ScheduleError(f"schedule {schedule.name!r} streams {schedule.minibatches} "
                            "mini-batches; PyTorch's CSV holds one flushed mini-batch")
    weighed = {(a.stage, a.mb) for stage in schedule.actions for a in stage if a.kind is W}
    rows = [[to_pytorch(a, a.kind is B and (a.stage, a.mb) in weighed) for a in program]
            for program in schedule.device_programs]
    with open(path, "w", newline="") as file:
        csv.writer(file).writerows(rows)


def load_csv(path: str | os.PathLike, name: str | None = None,
             micro_batches: int | None = None) -> Schedule:
    """The schedule in a PyTorch pipelining CSV (save_csv's, or PyTorch's `_dump_csv`): row r
    is what rank r runs, in order; a rank whose row names several stages holds them all (the
    schedule's placement and programs). Empty cells (PyTorch's bubbles) are skipped. `name`
    defaults to the file's stem, `micro_batches` to one more than the largest micro-batch
    index."""
    path = pathlib.Path(path)
    try:
        with open(path, newline="") as file:
            rows = list(csv.reader(file))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise ScheduleError(f"cannot read a schedule from {str(path)!r}: {error}") from error
    while rows and not any(cell.strip() for cell in rows[-1]):  # blank lines at the end
        rows.pop()
    if not rows:
        raise ScheduleError(f"{str(path)!r} holds no rows; write one row of actions per rank")
    programs = []
    for r, row in enumerate(rows):
        try:
            programs.append([a for a in map(from_pytorch, row) if a is not None])
        except ScheduleError as error:
            raise ScheduleError(f"{str(path)!r}, row {r}: {error}") from None
    placement = _placement(path, programs)
    lists = [[a for program in programs for a in program if a.stage == s]
             for s in range(len(placement))]
    for r, row in enumerate(rows):
        _check_split_backwards(path, r, row)
    shared = placement != tuple(range(len(programs)))
    try:
        return Schedule.from_lists(lists, name or path.stem, micro_batches,
                                   placement=placement if shared else None,
                                   programs=programs if shared else None)
    except ValueError as error:
        raise ScheduleError(f"{str(path)!r}: {error}") from None


def _placement(path: pathlib.Path, programs: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Each stage's rank: the row whose actions name it (a stage runs on one rank only)."""
    rank: dict[int, int] = {}
    for r, program in enumerate(programs):
        for a in program:
            if rank.setdefault(a.stage, r) != r:
                raise ScheduleError(f"{str(path)!r}: stage {a.stage} has actions on rows "
                                    f"{rank[a.stage]} and {r}; a stage runs on one rank, so "
                                    "all its actions go in that rank's row")
    for r, program in enumerate(programs):
        if not program:
            raise ScheduleError(f"{str(path)!r}: row {r} holds no action; every rank runs a "
                                "stage (remove the empty row)")
    missing = sorted(set(range(max(rank) + 1)) - set(rank))
    if missing:
        raise ScheduleError(f"{str(path)!r}: no row runs stage(s) {missing}; number the "
                            f"stages 0..{max(rank)} and give each its actions")
    return tuple(rank[s] for s in range(len(rank)))


def _check_split_backwards(path: pathlib.Path, r: int, row: Sequence[str]) -> None:
    """A PyTorch I must have its W on the stage, and a full B must not (its weight gradient
    would be computed twice)."""
    codes: dict[tuple[int, str], set[int]] = {}
    for cell in row:
        match = _PATTERN.fullmatch(cell.strip())
        if match and match[2] in "IBW" and match[3]:
            codes.setdefault((int(match[1]), match[2]), set()).add(int(match[3]))
    for s in sorted({stage for stage, _ in codes}):
        inputs, whole, weights = (codes.get((s, c), set()) for c in "IBW")
        for mb in sorted(inputs - weights):
            raise ScheduleError(f"{str(path)!r}, row {r}: {s}I{mb} computes micro-batch {mb}'s "
                                f"input gradient alone, but no {s}W{mb} computes its weight "
                                f"gradient; add {s}W{mb}, or write {s}B{mb} (the full "
                                "backward)")
        for mb in sorted(whole & weights):
            raise ScheduleError(f"{str(path)!r}, row {r}: {s}B{mb} is a full backward, which "
                                f"computes the weight gradient {s}W{mb} computes again; write "
                                f"{s}I{mb} (the input gradient alone) instead of {s}B{mb}")
