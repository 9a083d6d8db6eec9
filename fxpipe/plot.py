"""Pictures: the measured and the predicted timeline of a step, one above the other."""

from __future__ import annotations

import os
from collections.abc import Sequence

from fxpipe.errors import FxpipeError
from fxpipe.ir import Event
from fxpipe.schedules import ActionKind

__all__ = ["save_timeline"]

_COLOURS = {
    ActionKind.F: ("#4c72b0", "forward"), ActionKind.B: ("#dd8452", "backward"),
    ActionKind.W: ("#c44e52", "weight grad"), ActionKind.ALLREDUCE: ("#8172b3", "all-reduce"),
    ActionKind.STEP: ("#222222", "optimizer step"),
}
_COMM = ("#b0b0b0", "send / wait for recv")


def save_timeline(path: str | os.PathLike, timelines: dict[str, Sequence[Event]], stages: int,
                  title: str = "") -> None:
    """Draw each timeline (e.g. measured, predicted) as one panel, one row per stage, on a
    shared time axis in milliseconds; colours tell forward, backward, communication and
    all-reduce apart, and micro-batch numbers are written where they fit."""
    try:  # a Figure of its own, not pyplot's: the process's backend and figures stay as they are
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise FxpipeError("timeline pictures need matplotlib: pip install 'fxpipe[plot]'") from e
    span = max((e.end - min(x.start for x in t) for t in timelines.values() if t for e in t),
               default=1e-3) * 1e3
    figure = Figure(figsize=(12, 0.55 * stages * len(timelines) + 1.6))
    axes = figure.subplots(len(timelines), 1, sharex=True, squeeze=False)
    for axis, (name, events) in zip(axes[:, 0], timelines.items()):
        origin = min((e.start for e in events), default=0.0)
        for e in events:
            colour, _ = _COLOURS.get(e.action.kind, _COMM)
            left, width = (e.start - origin) * 1e3, max(e.duration * 1e3, span * 1e-4)
            axis.barh(e.stage, width, left=left, height=0.7, color=colour, linewidth=0)
            if e.action.kind in (ActionKind.F, ActionKind.B) and width > span / 60:
                axis.text(left + width / 2, e.stage, str(e.action.mb), ha="center",
                          va="center", fontsize=7, color="white")
        makespan = max((e.end for e in events), default=origin) - origin
        axis.set_title(f"{name}: {makespan * 1e3:.1f} ms", loc="left", fontsize=10)
        axis.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
        axis.set_ylim(stages - 0.5, -0.5)
        axis.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time in the step (ms)")
    kinds = {e.action.kind for events in timelines.values() for e in events}
    shown = [_COLOURS[k] for k in _COLOURS if k in kinds]
    if kinds - set(_COLOURS):
        shown.append(_COMM)
    handles = [Patch(color=c, label=label) for c, label in shown]
    figure.legend(handles=handles, loc="upper right", ncol=len(handles), fontsize=8,
                  frameon=False)
    if title:
        figure.suptitle(title, x=0.01, ha="left", fontsize=11)
    figure.tight_layout(rect=(0, 0, 1, 0.94))
    figure.savefig(path, dpi=110)
