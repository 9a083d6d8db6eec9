"""Schedule generators: compute-only per-stage action lists (GPipe, 1F1B, async 1F1B, ZB-H1)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from fxpipe.schedules.actions import Action, ActionKind, B, F, Schedule, W, _positive
from fxpipe.schedules.zero_bubble import zb_h1

__all__ = ["SCHEDULES", "async_one_f_one_b", "build", "device_peak_activations", "forwards_first",
           "gpipe", "one_f_one_b", "peak_activations"]


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
    """The compute-only schedule called `name`: a key of SCHEDULES (one stage per device), or
    of VIRTUAL_SCHEDULES (several stages per device; pass devices=N)."""
    from fxpipe.schedules.interleaved import VIRTUAL_SCHEDULES  # it builds on this module

    generators = {**SCHEDULES, **VIRTUAL_SCHEDULES}
    if name not in generators:
        known = ", ".join(repr(k) for k in generators)
        raise ValueError(f"unknown schedule {name!r}; choose one of {known}")
    needs = inspect.signature(generators[name]).parameters.get("devices")
    if needs is not None and needs.default is inspect.Parameter.empty and "devices" not in kw:
        raise ValueError(f"schedule {name!r} places several stages on each device; say how many "
                         f"devices: build({name!r}, {stages}, {micro_batches}, devices=N)")
    return generators[name](stages, micro_batches, **kw)


def device_peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per device, the most micro-batch activations its stages hold at once (F done, B not),
    one per stage and micro-batch, in the order its program runs them (`peak_activations`
    when every device holds one stage)."""
    return tuple(_peak(program) for program in schedule.device_programs)


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations are held at once: from F to B, or
    to W where the stage's backward of that micro-batch is split (the weight gradient needs
    them too)."""
    return tuple(_peak(stage) for stage in schedule.actions)


def _peak(actions: Sequence[Action]) -> int:
    split = {(a.stage, a.mb) for a in actions if a.kind is W}  # a device's program: stages
    held = peak = 0
    for a in actions:
        done = a.kind is W or (a.kind is B and (a.stage, a.mb) not in split)
        held += (a.kind is F) - done
        peak = max(peak, held)
    return peak


def forwards_first(actions: Sequence[Action]) -> bool:
    """Whether a stage's `actions` run every forward before the first backward (GPipe), so the
    stage holds every micro-batch's inputs until its backward anyway. The runtime posts all
    the receives of such a stage at the start of a run, and otherwise each one just before
    the compute ahead of it."""
    kinds = [a.kind for a in actions]
    return B not in kinds or F not in kinds[kinds.index(B):]


