"""Schedule generators: compute-only per-stage action lists (GPipe, 1F1B, async 1F1B, ZB-H1)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fxpipe.schedules.actions import Action, ActionKind, B, F, Schedule, W, _positive
from fxpipe.schedules.zero_bubble import zb_h1

__all__ = ["SCHEDULES", "async_one_f_one_b", "build", "forwards_first", "gpipe", "one_f_one_b",
           "peak_activations"]


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
    "zb-h1": zb_h1,
}


def build(name: str, stages: int, micro_batches: int, **kw: int) -> Schedule:
    """The compute-only schedule called `name` (a key of SCHEDULES)."""
    if name not in SCHEDULES:
        known = ", ".join(repr(k) for k in SCHEDULES)
        raise ValueError(f"unknown schedule {name!r}; choose one of {known}")
    return SCHEDULES[name](stages, micro_batches, **kw)


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations are held at once: from F to B, or
    to W where the stage's backward of that micro-batch is split (the weight gradient needs
    them too)."""
    peaks = []
    for stage in schedule.actions:
        split = {a.mb for a in stage if a.kind is W}
        held = peak = 0
        for a in stage:
            done = a.kind is W or (a.kind is B and a.mb not in split)
            held += (a.kind is F) - done
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


